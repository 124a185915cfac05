/* test_minicache.c — the MiniCache family (kernels/schemes/minicache.c) and the seam's windows in steps
 * (kvq_hooks.chunk, kvq_engine_run):
 *  - decode equivalence: kveval's engine run (the window in steps of C tokens, each step attending the
 *    cache the family built as its prefix) equals a step-by-step loop that keeps its own cache, built
 *    here from the paper's formulas written out again (angular distance, the retention rule with its
 *    running d_min / d_max or the artifact's thresholds, SLERP of the directions, per-layer fp16
 *    magnitudes, the per-vector quantizer); the same logits and NLLs bit for bit and the same merged /
 *    retained counts, on both tiny models (stories260K: GQA, head_dim 8; aidreams260K: head_dim 16), for
 *    C = 1 (a token-by-token decode) and C > 1, fp16 and b-bit storage, sink tokens, t and gamma;
 *    merging changes the loss, and C = 1 differs from C = window (no query reads a merged state);
 *  - calib->finish (its first user): fit_layer + finish on a synthetic dump whose layer pairs have
 *    known distances choose the nearest disjoint pairs from `from` on, thresholds by hand; too many
 *    pairs refused; kvdump -> kvcalib --method minicache on aidreams260K: the pairs are the greedy
 *    choice over the mean angular distances recomputed here from the dump; the artifact read back
 *    drives minicache<b>-cal through the same decode oracle;
 *  - the seam: a per-token transform run in steps of 7 tokens (the cache as the prefix) gives the same
 *    logits, NLLs and LM-head outputs bit for bit as the window at once; steps after an IntactKV prefix
 *    and a workspace without room for the steps' prefix are refused;
 *  - kvstat's cross-layer view (xlayer.h) by hand on the synthetic layers, with and without an artifact;
 *  - spec, canonical name, bits by hand (nominal and from counts), refusals naming the rule. */
#include <math.h>
#include <stdint.h>
#include <unistd.h>

#include "artifact.h"
#include "calibrate.h"
#include "device.h"
#include "dump.h"
#include "family.h"
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function" /* the fixtures this test does not use */
#include "family_env.h"
#pragma GCC diagnostic pop
#include "forward.h"
#include "identity.h"
#include "kv_desc.h"
#include "kvq_test.h"
#include "scheme.h"
#include "xlayer.h"

/* ---------------- the reference: the step-by-step cache, written out again ---------------- */

typedef struct {
    const kvq_scheme *q;
    const kvq_artifact *art; /* -cal: thresholds and pairs */
    int L, H, hd, kvd, N, step0;
    signed char role[64];    /* 1 first of a pair, 2 second, 0 unpaired */
    float *x_k, *x_v;        /* [L][N][kvd]: the exact states */
    float *c_k, *c_v;        /* [L][N][kvd]: the cache */
    double dmin[64][2][16], dmax[64][2][16];
    long merged, retained;   /* elements, both sides, both layers */
} ref_t;

static void ref_q(const kvq_scheme *q, float *x, int hd)
{
    kvq_err e = {0};
    if (q->variant == 1) {
        ck_assert(kvq_quant_int_token(x, x, 1, (size_t)hd, (size_t)hd, q->k_bits, 0, NULL, &e) == KVQ_OK);
        return;
    }
    for (int i = 0; i < hd; i++) x[i] = kvq_round_fp16(x[i]);
}

static kvq_status ref_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *e)
{
    (void)alt;
    (void)e;
    ref_t *r = user;
    ck_assert_int_eq(c->pos0, r->step0);
    for (int t = 0; t < c->T; t++) {
        size_t o = ((size_t)c->layer * r->N + c->pos0 + t) * r->kvd;
        memcpy(r->x_k + o, k + (size_t)t * r->kvd, (size_t)r->kvd * sizeof(float));
        memcpy(r->x_v + o, v + (size_t)t * r->kvd, (size_t)r->kvd * sizeof(float));
        if (r->role[c->layer]) continue; /* pair layers: exact within the step */
        if (c->pos0 + t >= (int)r->q->n_sink)
            for (int h = 0; h < r->H; h++) {
                ref_q(r->q, k + (size_t)t * r->kvd + (size_t)h * r->hd, r->hd);
                ref_q(r->q, v + (size_t)t * r->kvd + (size_t)h * r->hd, r->hd);
            }
        memcpy(r->c_k + o, k + (size_t)t * r->kvd, (size_t)r->kvd * sizeof(float));
        memcpy(r->c_v + o, v + (size_t)t * r->kvd, (size_t)r->kvd * sizeof(float));
    }
    return KVQ_OK;
}

static double ref_dist(const float *a, const float *b, int hd, double *na, double *nb)
{
    double s = 0, sa = 0, sb = 0;
    for (int i = 0; i < hd; i++) {
        s += (double)a[i] * b[i];
        sa += (double)a[i] * a[i];
        sb += (double)b[i] * b[i];
    }
    *na = sqrt(sa);
    *nb = sqrt(sb);
    if (!(*na > 0 && *nb > 0)) return 1;
    double cs = fmax(-1.0, fmin(1.0, s / (*na * *nb)));
    return acos(cs) / 3.14159265358979323846;
}

/* merge tokens [p0, p1) of every pair after a step */
static void ref_merge(ref_t *r, int p0, int p1)
{
    const double t = r->q->x[0], g = r->q->x[1];
    for (int l = 0; l + 1 < r->L; l++) {
        if (r->role[l] != 1) continue;
        for (int side = 0; side < 2; side++) {
            float *X = side ? r->x_v : r->x_k, *Cc = side ? r->c_v : r->c_k;
            /* the running range first: every token of the step, then the decisions */
            for (int j = p0; j < p1 && !r->art; j++)
                for (int h = 0; h < r->H; h++) {
                    if (j < (int)r->q->n_sink) continue;
                    double na, nb, d = ref_dist(X + ((size_t)l * r->N + j) * r->kvd + (size_t)h * r->hd,
                                                X + ((size_t)(l + 1) * r->N + j) * r->kvd + (size_t)h * r->hd, r->hd, &na, &nb);
                    if (d < 1) {
                        r->dmin[l][side][h] = fmin(r->dmin[l][side][h], d);
                        r->dmax[l][side][h] = fmax(r->dmax[l][side][h], d);
                    }
                }
            for (int j = p0; j < p1; j++)
                for (int h = 0; h < r->H; h++) {
                    size_t oa = ((size_t)l * r->N + j) * r->kvd + (size_t)h * r->hd, ob = oa + (size_t)r->N * r->kvd;
                    const float *a = X + oa, *b = X + ob;
                    float *ca = Cc + oa, *cb = Cc + ob;
                    memcpy(ca, a, (size_t)r->hd * sizeof(float));
                    memcpy(cb, b, (size_t)r->hd * sizeof(float));
                    if (j < (int)r->q->n_sink) continue;
                    double na, nb, d = ref_dist(a, b, r->hd, &na, &nb);
                    double th = r->art ? (double)kvq_kv_table_get(side ? &r->art->v[l] : &r->art->k[l], "theta")->data[h]
                                       : r->dmax[l][side][h] - (r->dmax[l][side][h] - r->dmin[l][side][h]) * g;
                    if (d >= 1 || d > th) {
                        ref_q(r->q, ca, r->hd);
                        ref_q(r->q, cb, r->hd);
                        r->retained += 2 * r->hd;
                        continue;
                    }
                    double W = d * 3.14159265358979323846, s = sin(W);
                    double wa = s < 1e-6 ? 1 - t : sin((1 - t) * W) / s, wb = s < 1e-6 ? t : sin(t * W) / s;
                    float e[64];
                    for (int i = 0; i < r->hd; i++) e[i] = (float)(wa * a[i] / na + wb * b[i] / nb);
                    ref_q(r->q, e, r->hd);
                    float ma = kvq_round_fp16((float)na), mb = kvq_round_fp16((float)nb);
                    for (int i = 0; i < r->hd; i++) {
                        ca[i] = e[i] * ma;
                        cb[i] = e[i] * mb;
                    }
                    r->merged += 2 * r->hd;
                }
        }
    }
}

/* the engine's run of `spec` (steps of C) against the reference loop; returns the loss */
static double mc_decode_case(const kvq_model *m, const char *spec, const kvq_artifact_set *set, double *loss_fp32)
{
    kvq_err e = {0};
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make(spec, set, &m->hp, &s, &e) == KVQ_OK, "%s: %s", spec, e.msg);
    enum { N = 40 };
    const int V = m->hp.vocab_size, kvd = kvq_kv_dim(&m->hp), L = m->hp.n_layers, H = m->hp.n_kv_heads;
    ck_assert_int_le(L, 64);
    ck_assert_int_le(H, 16);
    int tok[N];
    fenv_tokens(tok, N, V, 991);
    kvq_engine eng;
    ck_assert_msg(kvq_engine_init(&eng, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, m, N, N, KVQ_FWD_ROW_INVARIANT, &e) == KVQ_OK, "%s", e.msg);
    float *lb = malloc((size_t)N * V * sizeof(float)), *ld = malloc((size_t)N * V * sizeof(float));
    double nll_b[N], nll_d[N];
    kvq_scheme_run run;
    kvq_hooks hk;
    kvq_scheme_hooks(&run, &s, &hk);
    const kvq_scheme *q = &s.s.q;
    const int C = (int)q->x[3];
    ck_assert_int_eq(hk.chunk, C);
    ck_assert_ptr_nonnull(hk.cache);
    kvq_fwd_io io = {.tokens = tok, .T = N, .hooks = &hk, .logits = lb, .nll = nll_b};
    kvq_fwd_result res;
    ck_assert_msg(kvq_engine_run(&eng, &io, &res, &e) == KVQ_OK, "%s: %s", spec, e.msg);
    double loss_b = res.loss;
    ck_assert_int_eq(res.n_scored, N - 1);
    kvq_scheme_run_free(&run);

    /* the reference loop: steps of C tokens, the cache as the prefix */
    ref_t r = {.q = q, .art = q->x[2] == -2 ? s.art : NULL, .L = L, .H = H, .hd = m->hp.head_dim, .kvd = kvd, .N = N};
    size_t cn = (size_t)L * N * kvd;
    r.x_k = calloc(cn, sizeof(float));
    r.x_v = calloc(cn, sizeof(float));
    r.c_k = calloc(cn, sizeof(float));
    r.c_v = calloc(cn, sizeof(float));
    for (int l = 0; l < L; l++)
        for (int sd = 0; sd < 2; sd++)
            for (int h = 0; h < H; h++) {
                r.dmin[l][sd][h] = 2;
                r.dmax[l][sd][h] = -1;
            }
    if (r.art) {
        for (int l = 0; l + 1 < L; l++)
            if (kvq_kv_table_get(&r.art->k[l], "merge")->data[0] == 1) r.role[l] = 1, r.role[l + 1] = 2;
    } else
        for (int l = q->x[2] >= 0 ? (int)q->x[2] : L / 2; l + 1 < L; l += 2) r.role[l] = 1, r.role[l + 1] = 2;
    float *pk = malloc(cn * sizeof(float)), *pv = malloc(cn * sizeof(float));
    kvq_hooks hr = {.user = &r, .transform = ref_transform, .key_stage = KVQ_KEYS_POST_ROPE};
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, m, N, N, KVQ_FWD_ROW_INVARIANT, &e) == KVQ_OK);
    double loss_d = 0;
    for (int t0 = 0; t0 < N; t0 += C) {
        int n = N - t0 < C ? N - t0 : C;
        for (int l = 0; l < L; l++) {
            memcpy(pk + (size_t)l * t0 * kvd, r.c_k + (size_t)l * N * kvd, (size_t)t0 * kvd * sizeof(float));
            memcpy(pv + (size_t)l * t0 * kvd, r.c_v + (size_t)l * N * kvd, (size_t)t0 * kvd * sizeof(float));
        }
        kvq_prefix px = {.P = t0, .k = pk, .v = pv};
        int tg[N];
        for (int i = 0; i < n; i++) tg[i] = t0 + i + 1 < N ? tok[t0 + i + 1] : -1;
        r.step0 = t0;
        kvq_fwd_io io1 = {.tokens = tok + t0, .T = n, .pos0 = t0, .targets = tg, .prefix = t0 ? &px : NULL, .hooks = &hr,
                          .logits = ld + (size_t)t0 * V, .nll = nll_d + t0};
        ck_assert_msg(kvq_forward_run(&fw, &io1, &res, &e) == KVQ_OK, "%s", e.msg);
        for (int i = 0; i < n; i++)
            if (t0 + i + 1 < N) loss_d += nll_d[t0 + i];
        ref_merge(&r, t0, t0 + n);
    }
    loss_d /= N - 1;
    size_t logit_diff = fenv_bits_differ(lb, ld, (size_t)N * V);
    int first_div = -1;
    for (int t = 0; t + 1 < N && first_div < 0; t++)
        if (memcmp(&nll_b[t], &nll_d[t], sizeof(double))) first_div = t;
    kvq_fwd_io io0 = {.tokens = tok, .T = N};
    ck_assert(kvq_forward_run(&fw, &io0, &res, &e) == KVQ_OK);
    *loss_fp32 = res.loss;
    long km = (long)run.k_counts.n_exact + (long)run.v_counts.n_exact, kr = (long)run.k_counts.n_high + (long)run.v_counts.n_high;
    fprintf(stderr, "INFO decode %-34s %s: engine %.9f reference %.9f fp32 %.9f, %zu logits differ, first NLL difference at %d; "
                    "merged %ld (reference %ld), retained %ld (reference %ld) elements\n",
            s.name, m->path, loss_b, loss_d, res.loss, logit_diff, first_div, km, r.merged, kr, r.retained);
    /* the engine's loss is the steps' losses weighted by their scored positions: the same NLLs summed in another order */
    ck_assert_msg(logit_diff == 0 && first_div < 0 && fabs(loss_b - loss_d) <= 1e-12 * loss_d, "%s: engine %.12g vs reference %.12g, %zu logits differ, "
                  "first NLL difference at %d", s.name, loss_b, loss_d, logit_diff, first_div);
    ck_assert_int_eq(km, r.merged);
    ck_assert_int_eq(kr, r.retained);
    ck_assert_uint_eq(run.k_counts.n_elems, (uint64_t)L * N * kvd);
    ck_assert_msg(r.merged > 0, "%s merged nothing", s.name);
    ck_assert_msg(fabs(loss_b - res.loss) / res.loss > 1e-5, "%s barely changes the loss (%.3g vs fp32 %.3g)", s.name, loss_b, res.loss);
    kvq_forward_free(&fw);
    kvq_engine_free(&eng);
    free(pk);
    free(pv);
    free(r.x_k);
    free(r.x_v);
    free(r.c_k);
    free(r.c_v);
    free(lb);
    free(ld);
    return loss_b;
}

START_TEST(test_minicache_decode_equivalence)
{
    char buf[4096];
    const char *models[] = {"models/llama2c/stories260K.bin", "models/llama2c/aidreams260K.bin"};
    for (int mi = 0; mi < 2; mi++) {
        const char *p = kvq_test_shared(buf, sizeof buf, models[mi]);
        KVQ_SKIP_IF(!p, "../shared/models/llama2c tiny models absent");
        kvq_model m;
        kvq_err e = {0};
        ck_assert_msg(kvq_model_load(p, &m, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_int_ge(m.hp.n_layers, 4);
        double f32;
        double l1 = mc_decode_case(&m, "minicache4", NULL, &f32);                    /* S = L/2, t 0.6, gamma 0.05, C 1 */
        mc_decode_case(&m, "minicache-s0-g0", NULL, &f32);                           /* fp16, nothing retained */
        mc_decode_case(&m, "minicache3-s1-t0.3-g0.2-c5+sink2", NULL, &f32);          /* steps of 5, sink tokens */
        double l0 = mc_decode_case(&m, "minicache2-s0-g1-c3", NULL, &f32);           /* retain all but the nearest */
        (void)l0;
        /* one step of the whole window: no query reads a merged state (the pair layers' stay exact) */
        kvq_eval_scheme s;
        ck_assert(kvq_eval_scheme_make("minicache4-c64", NULL, &m.hp, &s, &e) == KVQ_OK);
        kvq_engine eng;
        ck_assert(kvq_engine_init(&eng, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, 40, 40, KVQ_FWD_ROW_INVARIANT, &e) == KVQ_OK);
        int tok[40];
        fenv_tokens(tok, 40, m.hp.vocab_size, 991);
        kvq_scheme_run run;
        kvq_hooks hk;
        kvq_scheme_hooks(&run, &s, &hk);
        kvq_fwd_io io = {.tokens = tok, .T = 40, .hooks = &hk};
        kvq_fwd_result res;
        ck_assert_msg(kvq_engine_run(&eng, &io, &res, &e) == KVQ_OK, "%s", e.msg);
        kvq_scheme_run_free(&run);
        ck_assert_uint_gt(run.k_counts.n_exact + run.k_counts.n_high, 0); /* the resting cache is merged, no query read it */
        ck_assert_msg(res.loss != l1, "C = 1 and one step of the window give the same loss %.9g", l1);
        kvq_engine_free(&eng);
        kvq_model_free(&m);
    }
}
END_TEST

/* ---------------- calib->finish on a synthetic dump ---------------- */

enum { SL = 6, SH = 2, SD = 4, SROWS = 12 };

typedef struct {
    float x[SL][2][SROWS][SH * SD];
} syn_dump;

static kvq_status syn_read(const kvq_calib_src *src, int layer, int ds, float *buf, kvq_err *err)
{
    const syn_dump *d = src->ctx;
    if (ds != 1 && ds != 2) return kvq_fail(err, KVQ_EINVAL, "synthetic dump: dataset %d absent", ds);
    memcpy(buf, d->x[layer][ds - 1], sizeof d->x[layer][ds - 1]);
    return KVQ_OK;
}

/* layer l's rows: a base direction per (row, head) rotated by an angle that grows with the layer's "drift" */
static void syn_make(syn_dump *d, const double drift[SL])
{
    uint32_t st = 17;
    for (int side = 0; side < 2; side++)
        for (int r = 0; r < SROWS; r++)
            for (int h = 0; h < SH; h++) {
                float base[SD], perp[SD];
                for (int i = 0; i < SD; i++) {
                    st = st * 1664525u + 1013904223u;
                    base[i] = (float)((st >> 8) % 1000) / 500.0f - 1.0f;
                    st = st * 1664525u + 1013904223u;
                    perp[i] = (float)((st >> 8) % 1000) / 500.0f - 1.0f;
                }
                /* orthonormal base and perp: the angle between layers is exactly the accumulated drift */
                double nb = 0, dp = 0, np = 0;
                for (int i = 0; i < SD; i++) nb += (double)base[i] * base[i];
                for (int i = 0; i < SD; i++) base[i] = (float)(base[i] / sqrt(nb));
                for (int i = 0; i < SD; i++) dp += (double)base[i] * perp[i];
                for (int i = 0; i < SD; i++) perp[i] = (float)(perp[i] - dp * base[i]);
                for (int i = 0; i < SD; i++) np += (double)perp[i] * perp[i];
                for (int i = 0; i < SD; i++) perp[i] = (float)(perp[i] / sqrt(np));
                double acc = 0;
                for (int l = 0; l < SL; l++) {
                    acc += drift[l] * (1 + 0.1 * (r % 3));
                    for (int i = 0; i < SD; i++)
                        d->x[l][side][r][h * SD + i] = (float)((cos(acc) * base[i] + sin(acc) * perp[i]) * (1 + l));
                }
            }
}

START_TEST(test_minicache_calib_finish)
{
    const kvq_family *f = KVQ_FAM("minicache");
    ck_assert_ptr_nonnull(f);
    ck_assert_ptr_nonnull(f->calib->finish);
    /* the angle added entering layer l (layer l against l-1): (2,3) is the closest pair, then (4,5);
     * (1,2) is closer than (4,5)'s neighbours but overlaps (2,3) */
    const double drift[SL] = {0, 0.9, 0.3, 0.05, 1.2, 0.2};
    syn_dump *d = calloc(1, sizeof *d);
    syn_make(d, drift);
    kvq_calib_src src = {.ctx = d, .n_samples = 2, .seq_len = SROWS / 2, .n_layers = SL, .n_heads = SH, .n_kv_heads = SH,
                         .head_dim = SD, .rope_dim = SD, .read = syn_read};
    kvq_artifact a = {0};
    a.p.method = f;
    a.p.k_bits = a.p.v_bits = 4;
    a.p.post_rope = true;
    a.p.n_sink = 1;
    a.p.n_layers = SL;
    a.p.n_kv_heads = SH;
    a.p.head_dim = SD;
    memcpy(a.p.x, f->calib->x, sizeof a.p.x);
    ck_assert(a.p.x[0] == 0.6 && a.p.x[1] == 0.05 && a.p.x[2] == 0 && a.p.x[3] == 0);
    a.p.x[2] = 2;
    kvq_err e = {0};
    ck_assert_msg(f->artifact->check_params(&a.p, &e) == KVQ_OK, "%s", e.msg);
    a.k = calloc(SL, sizeof *a.k);
    a.v = calloc(SL, sizeof *a.v);
    for (int l = 0; l < SL; l++) ck_assert_msg(f->calib->fit_layer(&a.p, l, &src, &a.k[l], &a.v[l], &e) == KVQ_OK, "%s", e.msg);
    /* distances and thresholds by hand: tokens 1..5 of each sample (sink 1) */
    for (int l = 0; l + 1 < SL; l++)
        for (int side = 0; side < 2; side++)
            for (int h = 0; h < SH; h++) {
                double s = 0, mn = 2, mx = -1;
                int n = 0;
                for (int r = 0; r < SROWS; r++) {
                    if (r % (SROWS / 2) < 1) continue;
                    double na, nb, dd = ref_dist(&d->x[l][side][r][h * SD], &d->x[l + 1][side][r][h * SD], SD, &na, &nb);
                    s += dd, n++, mn = fmin(mn, dd), mx = fmax(mx, dd);
                }
                const kvq_kv_table *t = side ? &a.v[l] : &a.k[l];
                ck_assert_double_eq_tol(kvq_kv_table_get(t, "dist")->data[h], s / n, 1e-6);
                ck_assert_double_eq_tol(kvq_kv_table_get(t, "theta")->data[h], mx - (mx - mn) * 0.05, 1e-6);
                ck_assert(kvq_kv_table_get(t, "merge")->data[0] == 0);
            }
    ck_assert(kvq_kv_table_get(&a.k[SL - 1], "dist")->data[0] == 0);
    ck_assert_msg(f->calib->finish(&a.p, &src, &a, &e) == KVQ_OK, "%s", e.msg);
    const int want[SL] = {0, 0, 1, 0, 1, 0}; /* pairs (2,3) (drift 0.05) then (4,5) (0.2) */
    for (int l = 0; l < SL; l++) {
        ck_assert_msg(kvq_kv_table_get(&a.k[l], "merge")->data[0] == want[l], "layer %d: merge %g, expected %d", l,
                      (double)kvq_kv_table_get(&a.k[l], "merge")->data[0], want[l]);
        ck_assert(kvq_kv_table_get(&a.v[l], "merge")->data[0] == want[l]);
        for (int side = 0; side < 2; side++)
            ck_assert_msg(f->artifact->check_tensors(&a.p, (size_t)l, side ? 'v' : 'k', side ? &a.v[l] : &a.k[l], &e) == KVQ_OK, "%s", e.msg);
    }
    /* kvstat's cross-layer view over the same data (a kvq_kvsrc over the arrays): the mean distance and the
     * retained share by hand, with the paper's rule (no sink) and with the artifact's thresholds (sink 1) */
    {
        const float *kp[SL], *vp[SL];
        for (int l = 0; l < SL; l++) kp[l] = &d->x[l][0][0][0], vp[l] = &d->x[l][1][0][0];
        int32_t toks[SROWS] = {0};
        kvq_kvsrc_mem mem = {.tokens = toks};
        mem.t[KVQ_KVT_K_PRE_ROPE] = kp;
        mem.t[KVQ_KVT_K] = kp;
        mem.t[KVQ_KVT_V] = vp;
        kvq_kvsrc xs = {.n_layers = SL, .layer_first = 0, .layer_last = SL - 1, .n_heads = SH, .n_kv_heads = SH, .head_dim = SD,
                        .n_samples = 2, .seq_len = SROWS / 2};
        strcpy(xs.model, "synthetic");
        ck_assert(kvq_kvsrc_mem_init(&xs, &mem, &e) == KVQ_OK);
        for (int with_art = 0; with_art < 2; with_art++) {
            kvq_xlayer xl;
            ck_assert_msg(kvq_xlayer_compute(&xs, with_art ? &a : NULL, 0.3, 0, true, &xl, &e) == KVQ_OK, "%s", e.msg);
            ck_assert_int_eq(xl.n_pairs, SL - 1);
            ck_assert_uint_eq(xl.n_vectors, (uint64_t)(with_art ? SROWS - 2 : SROWS) * SH);
            for (int l = 0; l + 1 < SL; l++)
                for (int side = 0; side < 2; side++) {
                    double sum = 0, sc = 0;
                    int n = 0, ret = 0;
                    for (int h = 0; h < SH; h++) {
                        double mn = 2, mx = -1, dd[SROWS];
                        for (int r = 0; r < SROWS; r++) {
                            double na, nb;
                            dd[r] = ref_dist(&d->x[l][side][r][h * SD], &d->x[l + 1][side][r][h * SD], SD, &na, &nb);
                            if (with_art && r % (SROWS / 2) < 1) dd[r] = -1; /* sink */
                        }
                        for (int r = 0; r < SROWS; r++)
                            if (dd[r] >= 0) mn = fmin(mn, dd[r]), mx = fmax(mx, dd[r]), sum += dd[r], sc += cos(dd[r] * M_PI), n++;
                        double th = with_art ? kvq_kv_table_get(side ? &a.v[l] : &a.k[l], "theta")->data[h] : mx - (mx - mn) * 0.3;
                        for (int r = 0; r < SROWS; r++) ret += dd[r] >= 0 && dd[r] > th;
                    }
                    ck_assert_double_eq_tol((side ? xl.dist_v : xl.dist_k)[l], sum / n, 1e-9);
                    ck_assert_double_eq_tol((side ? xl.cos_v : xl.cos_k)[l], sc / n, 1e-6);
                    ck_assert_double_eq_tol((side ? xl.ret_v : xl.ret_k)[l], (double)ret / n, 1e-12);
                }
            for (int l = 0; l + 1 < SL; l++) ck_assert_int_eq(xl.merged[l], with_art ? want[l] : -1);
            kvq_xlayer_free(&xl);
        }
    }
    /* from = 3: (2,3) is out of reach; (4,5) then (3,4)? overlaps: one pair only fits with from = 4 */
    for (int l = 0; l < SL; l++)
        for (int side = 0; side < 2; side++) ((kvq_fam_tensor *)kvq_kv_table_get(side ? &a.v[l] : &a.k[l], "merge"))->data[0] = 0;
    a.p.x[2] = 1;
    a.p.x[3] = 3;
    ck_assert(f->calib->finish(&a.p, &src, &a, &e) == KVQ_OK);
    ck_assert(kvq_kv_table_get(&a.k[4], "merge")->data[0] == 1 && kvq_kv_table_get(&a.k[3], "merge")->data[0] == 0);
    /* too many pairs: refused by the parameter check (3 pairs from layer 1 do not fit 6 layers) and by finish */
    a.p.x[2] = 3;
    a.p.x[3] = 1;
    ck_assert_int_ne(f->artifact->check_params(&a.p, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "kvq.minicache.pairs"), "%s", e.msg);
    ck_assert_int_ne(f->calib->finish(&a.p, &src, &a, &e), KVQ_OK);
    a.p.x[2] = 0; /* the paper's count: (6 - 3) / 2 = 1 */
    a.p.x[3] = 0;
    ck_assert(f->artifact->check_params(&a.p, &e) == KVQ_OK);
    a.p.x[0] = 1;
    ck_assert_int_ne(f->artifact->check_params(&a.p, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "kvq.minicache.t"), "%s", e.msg);
    a.p.x[0] = 0.6;
    a.p.post_rope = false;
    ck_assert_int_ne(f->artifact->check_params(&a.p, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "post-RoPE"), "%s", e.msg);
    /* a merge flag on the last layer is refused */
    ((kvq_fam_tensor *)kvq_kv_table_get(&a.k[SL - 1], "merge"))->data[0] = 1;
    a.p.post_rope = true;
    ck_assert_int_ne(f->artifact->check_tensors(&a.p, SL - 1, 'k', &a.k[SL - 1], &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "last layer"), "%s", e.msg);
    for (int l = 0; l < SL; l++) {
        kvq_kv_table_free(&a.k[l]);
        kvq_kv_table_free(&a.v[l]);
    }
    free(a.k);
    free(a.v);
    free(d);
}
END_TEST

/* ---------------- kvdump -> kvcalib --method minicache -> the decode oracle with -cal ---------------- */

START_TEST(test_minicache_kvcalib_chain)
{
    char dump[256], out[256], model[4096];
    snprintf(dump, sizeof dump, "/tmp/kvq_test_minicache_%d.h5", (int)getpid());
    snprintf(out, sizeof out, "/tmp/kvq_test_minicache_%d.safetensors", (int)getpid());
    unlink(out);
    KVQ_SKIP_IF(!fenv_dump("models/llama2c/aidreams260K.bin", 4, 48, false, dump, model, sizeof model),
                "../shared tiny model or WikiText-2 absent");
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("minicache"));
    ck_assert(o.post_rope);
    ck_assert_int_eq(o.k_bits, 4);
    o.n_sink = 1;
    o.x[2] = 1; /* one pair */
    kvq_err e = {0};
    ck_assert_msg(kvq_calibrate_file(dump, out, false, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact ar;
    ck_assert_msg(kvq_artifact_read(out, &ar, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(ar.p.method->name, "minicache");
    /* the pair is the one with the least mean angular distance (K and V heads averaged), recomputed here */
    kvq_dump_reader *dr = NULL;
    ck_assert_msg(kvq_dump_open(dump, &dr, &e) == KVQ_OK, "%s", e.msg);
    const kvq_dump_meta dm = *kvq_dump_reader_meta(dr);
    const int L = (int)dm.n_layers, H = (int)dm.n_kv_heads, hd = (int)dm.head_dim, kvd = H * hd, S = (int)dm.seq_len;
    size_t rows = (size_t)dm.n_samples * S;
    float *x = malloc((size_t)L * 2 * rows * kvd * sizeof(float));
    for (int l = 0; l < L; l++)
        for (int side = 0; side < 2; side++)
            for (int64_t smp = 0; smp < dm.n_samples; smp++)
                ck_assert(kvq_dump_read(dr, l, side ? KVQ_DUMP_V : KVQ_DUMP_K, smp,
                                        x + (((size_t)l * 2 + side) * rows + (size_t)smp * S) * kvd, &e) == KVQ_OK);
    kvq_dump_close(dr);
    int best = -1, chosen = -1;
    double bs = 9;
    for (int l = 0; l + 1 < L; l++) {
        double s = 0;
        for (int side = 0; side < 2; side++)
            for (int h = 0; h < H; h++) {
                double sum = 0;
                int n = 0;
                for (size_t r = 0; r < rows; r++) {
                    if ((int)(r % S) < 1) continue;
                    double na, nb;
                    sum += ref_dist(x + (((size_t)l * 2 + side) * rows + r) * kvd + h * hd,
                                    x + (((size_t)(l + 1) * 2 + side) * rows + r) * kvd + h * hd, hd, &na, &nb);
                    n++;
                }
                s += sum / n;
                ck_assert_double_eq_tol(kvq_kv_table_get(side ? &ar.v[l] : &ar.k[l], "dist")->data[h], sum / n, 1e-5);
            }
        if (s < bs) bs = s, best = l;
        if (kvq_kv_table_get(&ar.k[l], "merge")->data[0] == 1) {
            ck_assert_int_eq(chosen, -1);
            chosen = l;
        }
    }
    ck_assert_int_eq(chosen, best);
    free(x);
    kvq_artifact_free(&ar);
    /* the artifact drives minicache<b>-cal: the decode oracle with its pairs and thresholds */
    kvq_model m;
    ck_assert_msg(kvq_model_load(model, &m, &e) == KVQ_OK, "%s", e.msg);
    char fp[65];
    ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
    const char *paths[] = {out};
    kvq_artifact_set set;
    ck_assert_msg(kvq_artifact_set_load(&set, paths, 1, &m, fp, false, NULL, &e) == KVQ_OK, "%s", e.msg);
    double f32;
    mc_decode_case(&m, "minicache4-cal", &set, &f32);
    mc_decode_case(&m, "minicache3-cal-c4", &set, &f32);
    /* without the artifact: refused, the need named */
    kvq_eval_scheme s;
    ck_assert_int_ne(kvq_eval_scheme_make("minicache4-cal", NULL, &m.hp, &s, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "method minicache"), "%s", e.msg);
    kvq_artifact_set_free(&set);
    kvq_model_free(&m);
    unlink(dump);
    unlink(out);
}
END_TEST

/* ---------------- the seam: a window in steps equals the window at once for a per-token transform ---------------- */

typedef struct {
    int L, kvd, N;
    float *ck, *cv, *pk, *pv; /* [L][N][kvd] the cache; the packed prefix */
} step_cache;

static kvq_status step_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *e)
{
    (void)alt;
    step_cache *sc = user;
    KVQ_TRY(kvq_quant_int_token(k, k, (size_t)c->T, (size_t)sc->kvd, (size_t)c->head_dim, 3, 0, NULL, e));
    KVQ_TRY(kvq_quant_int_token(v, v, (size_t)c->T, (size_t)sc->kvd, (size_t)c->head_dim, 3, 0, NULL, e));
    size_t o = ((size_t)c->layer * sc->N + c->pos0) * sc->kvd, n = (size_t)c->T * sc->kvd;
    memcpy(sc->ck + o, k, n * sizeof(float));
    memcpy(sc->cv + o, v, n * sizeof(float));
    return KVQ_OK;
}

static kvq_status step_cache_fn(void *user, int P, kvq_prefix *out, kvq_err *e)
{
    (void)e;
    step_cache *sc = user;
    for (int l = 0; l < sc->L; l++) {
        memcpy(sc->pk + (size_t)l * P * sc->kvd, sc->ck + (size_t)l * sc->N * sc->kvd, (size_t)P * sc->kvd * sizeof(float));
        memcpy(sc->pv + (size_t)l * P * sc->kvd, sc->cv + (size_t)l * sc->N * sc->kvd, (size_t)P * sc->kvd * sizeof(float));
    }
    *out = (kvq_prefix){.P = P, .k = sc->pk, .v = sc->pv};
    return KVQ_OK;
}

START_TEST(test_engine_window_in_steps)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/stories260K.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c tiny models absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(p, &m, &e) == KVQ_OK, "%s", e.msg);
    enum { N = 40 };
    const int V = m.hp.vocab_size, D = m.hp.dim, L = m.hp.n_layers, kvd = kvq_kv_dim(&m.hp);
    int tok[N];
    fenv_tokens(tok, N, V, 5);
    size_t cn = (size_t)L * N * kvd;
    step_cache sc = {.L = L, .kvd = kvd, .N = N, .ck = calloc(cn, 4), .cv = calloc(cn, 4), .pk = calloc(cn, 4), .pv = calloc(cn, 4)};
    kvq_engine eng;
    ck_assert(kvq_engine_init(&eng, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, N, N, KVQ_FWD_ROW_INVARIANT, &e) == KVQ_OK);
    float *lg[2], *hid[2], *ex[2];
    double nll[2][N], lse[2][N], loss[2];
    int am[2][N];
    for (int r = 0; r < 2; r++) {
        lg[r] = malloc((size_t)N * V * sizeof(float));
        hid[r] = malloc((size_t)N * D * sizeof(float));
        ex[r] = malloc((size_t)N * D * sizeof(float));
        kvq_hooks hk = {.user = &sc, .transform = step_transform, .key_stage = KVQ_KEYS_POST_ROPE, .chunk = r ? 7 : 0,
                        .cache = r ? step_cache_fn : NULL};
        kvq_fwd_head head = {.hidden = hid[r], .lse = lse[r], .argmax = am[r], .expect = ex[r]};
        kvq_fwd_io io = {.tokens = tok, .T = N, .hooks = &hk, .logits = lg[r], .nll = nll[r], .head = &head};
        kvq_fwd_result res;
        ck_assert_msg(kvq_engine_run(&eng, &io, &res, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_int_eq(res.n_scored, N - 1);
        loss[r] = res.loss;
    }
    ck_assert_uint_eq(fenv_bits_differ(lg[0], lg[1], (size_t)N * V), 0);
    ck_assert_uint_eq(fenv_bits_differ(hid[0], hid[1], (size_t)N * D), 0);
    ck_assert_uint_eq(fenv_bits_differ(ex[0], ex[1], (size_t)(N - 1) * D), 0);
    for (int t = 0; t + 1 < N; t++) {
        ck_assert(memcmp(&nll[0][t], &nll[1][t], sizeof(double)) == 0);
        ck_assert(memcmp(&lse[0][t], &lse[1][t], sizeof(double)) == 0);
        ck_assert_int_eq(am[0][t], am[1][t]);
    }
    ck_assert_double_eq_tol(loss[0], loss[1], 1e-12 * loss[0]);
    /* refusals: after an IntactKV prefix; without room for the steps' prefix */
    kvq_hooks hk = {.user = &sc, .transform = step_transform, .key_stage = KVQ_KEYS_POST_ROPE, .chunk = 7, .cache = step_cache_fn};
    kvq_prefix px = {.P = 2, .k = sc.pk, .v = sc.pv};
    kvq_fwd_io io = {.tokens = tok, .T = N - 2, .pos0 = 2, .prefix = &px, .hooks = &hk};
    kvq_fwd_result res;
    ck_assert_int_ne(kvq_engine_run(&eng, &io, &res, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "IntactKV"), "%s", e.msg);
    kvq_engine_free(&eng);
    ck_assert(kvq_engine_init(&eng, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, N, 8, 0, &e) == KVQ_OK);
    kvq_fwd_io io2 = {.tokens = tok, .T = N, .hooks = &hk};
    ck_assert_int_ne(kvq_engine_run(&eng, &io2, &res, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "room for a prefix of up to 35"), "%s", e.msg);
    kvq_engine_free(&eng);
    for (int r = 0; r < 2; r++) free(lg[r]), free(hid[r]), free(ex[r]);
    free(sc.ck);
    free(sc.cv);
    free(sc.pk);
    free(sc.pv);
    kvq_model_free(&m);
}
END_TEST

/* ---------------- spec, bits, refusals ---------------- */

START_TEST(test_minicache_spec_bits)
{
    kvq_err e = {0};
    kvq_hparams hp = {.n_layers = 30, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64, .dim = 576, .vocab_size = 100, .ctx_len = 2048,
                      .rope_dim = 64};
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make("minicache4", NULL, &hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(s.name, "minicache4-t0.6-g0.05-c1");
    ck_assert(s.s.key_stage == KVQ_KEYS_POST_ROPE);
    ck_assert_int_eq(kvq_eval_scheme_code_bits(&s, 'k'), 4);
    /* nominal bits: S = 15, pairs (15,16)..(27,28): 7 pairs = 14 of 30 layers merged; q = 4 + 32/64 = 4.5;
     * merged element 4.5/2 + 16/64 = 2.5; (16 * 4.5 + 14 * 2.5) / 30 */
    kvq_bits b;
    ck_assert(kvq_eval_scheme_bits(&s, 2048, &hp, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, (16 * 4.5 + 14 * 2.5) / 30, 1e-12);
    ck_assert_double_eq_tol(b.v, b.k, 1e-12);
    /* from counts: 100 elements, 40 merged, 10 retained, 4 sink: (46 q + 40 (q/2 + 1/4) + 10 (q + 1/4) + 4 * 16) / 100 */
    kvq_quant_counts c = {.n_elems = 100, .n_exact = 40, .n_high = 10, .n_sink = 4};
    ck_assert(kvq_eval_scheme_bits_run(&s, 2048, &hp, &c, &c, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, (46 * 4.5 + 40 * 2.5 + 10 * 4.75 + 4 * 16.0) / 100, 1e-12);
    ck_assert_msg(kvq_eval_scheme_make("minicache-s20-t0.25-g0.5-c64+sink1", NULL, &hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(s.name, "minicache-s20-t0.25-g0.5-c64+sink1");
    ck_assert_int_eq(kvq_eval_scheme_code_bits(&s, 'v'), 16);
    ck_assert_int_eq(kvq_kv_desc_chunk(&s.desc), 64);
    /* fp16: 10 of 30 layers merged at 8 + 0.25 */
    kvq_scheme q = s.s.q;
    q.n_sink = 0;
    ck_assert(kvq_scheme_bits_ex(&q, &(kvq_bits_in){.ctx = 2048, .kv_dim = 192, .head_dim = 64, .n_layers = 30}, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, (20 * 16 + 10 * 8.25) / 30.0, 1e-12);
    /* refusals before any work, the rule named */
    const struct { const char *spec, *msg; } bad[] = {
        {"minicache4-t1", "0 < t < 1"},        {"minicache4-t0", "0 < t < 1"},
        {"minicache4-g1.5", "0 <= gamma <= 1"}, {"minicache9", "1..8"},
        {"minicache4-c0", "integer >= 1"},      {"minicache4-s29", "needs layer 30"},
        {"minicache4-q", "expected minicache"}, {"minicache4+pre-rope", "post-RoPE"},
        {"minicache4+hadamard", "rotation"},    {"minicache4-cal", "method minicache"},
        {"minicache4-t", "SLERP parameter"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_msg(kvq_eval_scheme_make(bad[i].spec, NULL, &hp, &s, &e) != KVQ_OK, "%s accepted", bad[i].spec);
        ck_assert_msg(strstr(e.msg, bad[i].msg), "%s: '%s' lacks '%s'", bad[i].spec, e.msg, bad[i].msg);
    }
    /* steps as long as the context: one step per window, nothing merged ever read (the row claimed 12.6 bits at KLD
     * 1e-7); refused before any work through the family's check_ctx, one token shorter accepted */
    ck_assert(kvq_eval_scheme_make("minicache4-c64", NULL, &hp, &s, &e) == KVQ_OK);
    ck_assert_ptr_nonnull(s.desc.q.fam->check_ctx);
    ck_assert_int_eq(s.desc.q.fam->check_ctx(&s.desc.q, s.name, 64, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "-c64") && strstr(e.msg, "shorter than the context"), "%s", e.msg);
    ck_assert_int_eq(s.desc.q.fam->check_ctx(&s.desc.q, s.name, 65, &e), KVQ_OK);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("minicache");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_minicache_spec_bits);
    tcase_add_test(tc, test_engine_window_in_steps);
    tcase_add_test(tc, test_minicache_calib_finish);
    tcase_add_test(tc, test_minicache_decode_equivalence);
    tcase_add_test(tc, test_minicache_kvcalib_chain);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
