/* test_kvstats.c — kvstat statistics against float64 references on synthetic
 * data (kvstat_synth.h): moments and their Chan/Pébay merge, sketch
 * percentiles within the documented error, planted outlier channels, known
 * kurtosis, pre/post-RoPE spread, a planted attention sink and pivot token,
 * quantization error and normalised histograms. */
#include <float.h>

#include "kvq_test.h"
#include "kvstat_synth.h"
#include "kvstats.h"
#include "kvsrc.h"
#include "quant.h"

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* float64 reference moments of a column, two-pass in long double */
static void ref_moments(const double *x, size_t n, double *mean, double *var, double *kurt)
{
    long double s = 0;
    for (size_t i = 0; i < n; i++) s += x[i];
    long double m = s / n, m2 = 0, m4 = 0;
    for (size_t i = 0; i < n; i++) { long double d = x[i] - m; m2 += d * d; m4 += d * d * d * d; }
    *mean = (double)m;
    *var = (double)(m2 / n);
    *kurt = (double)(n * m4 / (m2 * m2));
}

static bool rel_close(double a, double b, double tol) { return fabs(a - b) <= tol * fmax(1e-300, fmax(fabs(a), fabs(b))); }

START_TEST(test_moments_merge_equals_one_pass)
{
    uint64_t rng = 7;
    enum { N = 5000 };
    float *x = malloc(N * sizeof(float));
    double *xd = malloc(N * sizeof(double));
    for (int i = 0; i < N; i++) { x[i] = (float)(1e4 + 3 * sy_gauss(&rng) + (i % 7 == 0 ? 40 : 0)); xd[i] = x[i]; }
    double mean, var, kurt;
    ref_moments(xd, N, &mean, &var, &kurt);
    /* one value at a time */
    kvq_moments a = {0};
    for (int i = 0; i < N; i++) kvq_moments_push(&a, x[i]);
    /* uneven chunks merged */
    kvq_moments b = {0};
    size_t cuts[] = {0, 1, 2, 17, 999, 1000, 3333, N};
    for (size_t c = 0; c + 1 < sizeof cuts / sizeof *cuts; c++) {
        kvq_moments m = kvq_moments_of(x + cuts[c], cuts[c + 1] - cuts[c], 1);
        kvq_moments_merge(&b, &m);
    }
    /* the whole array two-pass */
    kvq_moments w = kvq_moments_of(x, N, 1);
    const kvq_moments *all[] = {&a, &b, &w};
    for (int k = 0; k < 3; k++) {
        ck_assert_msg(rel_close(all[k]->mean, mean, 1e-13), "%d mean %.17g vs %.17g", k, all[k]->mean, mean);
        ck_assert_msg(rel_close(kvq_moments_var(all[k]), var, 1e-10), "%d var %.17g vs %.17g", k, kvq_moments_var(all[k]), var);
        ck_assert_msg(rel_close(kvq_moments_kurtosis(all[k]), kurt, 1e-9), "%d kurt %.17g vs %.17g", k,
                      kvq_moments_kurtosis(all[k]), kurt);
    }
    /* merging with an empty side is the identity */
    kvq_moments e = {0}, c2 = b;
    kvq_moments_merge(&c2, &e);
    ck_assert(c2.n == b.n && c2.m4 == b.m4);
    kvq_moments_merge(&e, &b);
    ck_assert(e.n == b.n && e.m2 == b.m2);
    /* large offset: sum/sum² would lose everything here; the central form keeps var = 9 ± a few % */
    free(x);
    free(xd);
}
END_TEST

START_TEST(test_sketch_quantiles_within_alpha)
{
    kvq_sketch sk;
    kvq_err e = {0};
    ck_assert(kvq_sketch_init(&sk, 0.005, 1e-6, 1e6, &e) == KVQ_OK);
    uint64_t rng = 99;
    enum { N = 20011 };
    double *v = malloc(N * sizeof(double));
    uint64_t *cnt = calloc((size_t)sk.n_bins, sizeof(uint64_t));
    double mx = 0;
    for (int i = 0; i < N; i++) {
        v[i] = i % 1000 == 0 ? 0.0 : exp(3 * sy_gauss(&rng)); /* 1e-5 .. 1e5 and some zeros */
        cnt[kvq_sketch_bucket(&sk, v[i])]++;
        if (v[i] > mx) mx = v[i];
    }
    qsort(v, N, sizeof *v, cmp_d);
    double qs[] = {0.001, 0.01, 0.5, 0.9, 0.99, 0.999, 1.0};
    for (size_t i = 0; i < sizeof qs / sizeof *qs; i++) {
        size_t r = (size_t)ceil(qs[i] * N);
        double ref = v[r - 1], got = kvq_sketch_quantile(&sk, cnt, N, qs[i], mx);
        double tol = ref >= sk.vmin ? sk.alpha * ref * (1 + 1e-9) : sk.vmin;
        ck_assert_msg(fabs(got - ref) <= tol, "q=%g: got %.9g, exact %.9g (tol %.3g)", qs[i], got, ref, tol);
    }
    /* every bucket's representative is within alpha of both its edges */
    for (int k = 2; k < sk.n_bins - 1; k++) {
        double lo = sk.vmin * pow(sk.gamma, k - 2), hi = sk.vmin * pow(sk.gamma, k - 1), rep = kvq_sketch_value(&sk, k);
        ck_assert(rep >= lo && rep <= hi);
        ck_assert(fabs(rep - hi) <= sk.alpha * hi * (1 + 1e-9) && fabs(rep - lo) <= sk.alpha * lo * (1 + 1e-9));
    }
    ck_assert(kvq_sketch_init(&sk, 0.5, 1e-6, 1, &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "alpha"), "%s", e.msg);
    free(v);
    free(cnt);
}
END_TEST

/* Column c of layer j tensor t of the synthetic data, all samples and positions, as doubles. */
static void column(const synth_t *y, int t, int j, int c, double *out)
{
    for (size_t i = 0; i < (size_t)SY_N * SY_L; i++) out[i] = y->t[t][j][i * SY_KV + (size_t)c];
}

START_TEST(test_stats_match_float64_reference)
{
    synth_t y;
    ck_assert(synth_init(&y, 1, 0) == 0);
    kvq_kvstats_opts o = kvq_kvstats_opts_default();
    o.quiet = true;
    o.chunk_tokens = 13; /* slabs that do not divide L */
    kvq_kvstats *s;
    kvq_err e = {0};
    ck_assert_msg(kvq_kvstats_compute(&y.src, &o, &s, &e) == KVQ_OK, "%s", e.msg);
    enum { M = SY_N * SY_L };
    double col[M], a[M];
    for (int j = 0; j < SY_NL; j++)
        for (int t = 0; t < KVQ_KVT_N_STAT; t++)
            for (int c = 0; c < SY_KV; c++) {
                column(&y, t, j, c, col);
                const kvq_chan_stats *cs = &s->layers[j].t[t].chan[c];
                double mean, var, kurt, amean, avar, akurt, mx = 0, mn = INFINITY, mxs = -INFINITY;
                ref_moments(col, M, &mean, &var, &kurt);
                for (int i = 0; i < M; i++) {
                    a[i] = fabs(col[i]);
                    mx = fmax(mx, a[i]);
                    mn = fmin(mn, col[i]);
                    mxs = fmax(mxs, col[i]);
                }
                ref_moments(a, M, &amean, &avar, &akurt);
                ck_assert_uint_eq(cs->n, M);
                ck_assert(cs->absmax == mx && cs->min == mn && cs->max == mxs);
                ck_assert_msg(fabs(cs->mean - mean) <= 1e-12 * (1 + fabs(mean)), "mean %g vs %g", cs->mean, mean);
                ck_assert_msg(rel_close(cs->std, sqrt(var), 1e-11), "std");
                ck_assert_msg(rel_close(cs->kurtosis, kurt, 1e-10), "L%d %d c%d kurt %.15g vs %.15g", j, t, c, cs->kurtosis, kurt);
                ck_assert_msg(rel_close(cs->mean_abs, amean, 1e-12), "mean_abs");
                ck_assert_msg(rel_close(cs->std_abs, sqrt(avar), 1e-11), "std_abs");
                qsort(a, M, sizeof *a, cmp_d);
                double r99 = a[(int)ceil(0.99 * M) - 1], r999 = a[(int)ceil(0.999 * M) - 1];
                ck_assert_msg(fabs(cs->p99 - r99) <= s->sketch.alpha * r99 * (1 + 1e-9) + 1e-6, "p99 %g vs %g", cs->p99, r99);
                ck_assert_msg(fabs(cs->p999 - r999) <= s->sketch.alpha * r999 * (1 + 1e-9) + 1e-6, "p999 %g vs %g", cs->p999, r999);
            }
    /* pooled head and layer stats: the union of the channels */
    for (int t = 0; t < KVQ_KVT_N_STAT; t++) {
        double *all = malloc((size_t)M * SY_KV * sizeof(double));
        for (int c = 0; c < SY_KV; c++) column(&y, t, 1, c, all + (size_t)c * M);
        double mean, var, kurt;
        ref_moments(all, (size_t)M * SY_KV, &mean, &var, &kurt);
        const kvq_chan_stats *ls = &s->layers[1].t[t].all;
        ck_assert(ls->n == (uint64_t)M * SY_KV);
        ck_assert_msg(rel_close(ls->kurtosis, kurt, 1e-9), "layer kurt %.15g vs %.15g", ls->kurtosis, kurt);
        ck_assert(rel_close(ls->std, sqrt(var), 1e-10));
        ref_moments(all + (size_t)SY_D * M, (size_t)SY_D * M, &mean, &var, &kurt); /* head 1 */
        ck_assert(rel_close(s->layers[1].t[t].head[1].kurtosis, kurt, 1e-9));
        free(all);
    }
    /* planted distributions: Laplace (6) and uniform (1.8) value channels */
    ck_assert_msg(fabs(s->layers[0].t[KVQ_KVT_V].chan[5].kurtosis - 6) < 1.5, "laplace kurt %g", s->layers[0].t[KVQ_KVT_V].chan[5].kurtosis);
    ck_assert_msg(fabs(s->layers[0].t[KVQ_KVT_V].chan[7].kurtosis - 1.8) < 0.15, "uniform kurt %g", s->layers[0].t[KVQ_KVT_V].chan[7].kurtosis);
    /* token norms */
    for (int smp = 0; smp < SY_N; smp++)
        for (int p = 0; p < SY_L; p += 9) {
            double ss = 0;
            for (int c = 0; c < SY_KV; c++) { double v = y.t[KVQ_KVT_V][2][((size_t)smp * SY_L + p) * SY_KV + c]; ss += v * v; }
            ck_assert(rel_close(s->layers[2].t[KVQ_KVT_V].tok_norm[smp * SY_L + p], sqrt(ss), 1e-6));
        }
    kvq_kvstats_free(s);
    synth_free(&y);
}
END_TEST

START_TEST(test_outliers_spread_sinks)
{
    synth_t y;
    ck_assert(synth_init(&y, 1, 0) == 0);
    kvq_kvstats_opts o = kvq_kvstats_opts_default();
    o.quiet = true;
    kvq_kvstats *s;
    kvq_err e = {0};
    ck_assert_msg(kvq_kvstats_compute(&y.src, &o, &s, &e) == KVQ_OK, "%s", e.msg);
    for (int j = 0; j < SY_NL; j++) {
        const kvq_layer_stats *ls = &s->layers[j];
        const kvq_tensor_stats *kp = &ls->t[KVQ_KVT_K_PRE_ROPE];
        /* exactly the two planted channels, the larger first; ratio = mean|x| / median mean|x| */
        ck_assert_msg(kp->n_outliers == 2, "layer %d: %d outliers", j, kp->n_outliers);
        ck_assert_int_eq(kp->outlier_chan[0], sy_outlier1(j));
        ck_assert_int_eq(kp->outlier_chan[1], SY_OUTLIER2);
        ck_assert(rel_close(kp->outlier_ratio[0], kp->chan[sy_outlier1(j)].mean_abs / kp->median_stat, 1e-12));
        ck_assert_msg(kp->outlier_ratio[0] > 8 * 0.7 / 0.8 * 0.9, "ratio %g", kp->outlier_ratio[0]); /* E|N(8,2)| / E|N(0,1)| = 10 */
        /* values: none planted */
        ck_assert_int_eq(ls->t[KVQ_KVT_V].n_outliers, 0);
        /* RoPE smears channel magnitudes: variance of m_c falls, token-wise CV rises */
        ck_assert_msg(ls->spread_var_ratio > 1.2, "layer %d var ratio %g", j, ls->spread_var_ratio);
        ck_assert_msg(ls->cv_post > ls->cv_pre, "cv %g -> %g", ls->cv_pre, ls->cv_post);
        /* reference spread ratio from the per-channel means */
        double m[2][SY_KV];
        for (int w = 0; w < 2; w++)
            for (int c = 0; c < SY_KV; c++) m[w][c] = ls->t[w].chan[c].mean_abs;
        double v[2];
        for (int w = 0; w < 2; w++) {
            double mu = 0, q = 0;
            for (int c = 0; c < SY_KV; c++) mu += m[w][c] / SY_KV;
            for (int c = 0; c < SY_KV; c++) q += (m[w][c] - mu) * (m[w][c] - mu) / SY_KV;
            v[w] = q;
        }
        ck_assert(rel_close(ls->spread_var_ratio, v[0] / v[1], 1e-9));
        /* attention: position 0 is the top position; its share is analytic */
        ck_assert_int_eq(ls->top_pos, 0);
        ck_assert(ls->n_sinks >= 1);
        double share0 = (1 + 0.6 * (SY_L - 1)) / SY_L; /* samples without the pivot */
        bool found0 = false, found_piv = false;
        for (int i = 0; i < ls->n_sinks; i++) {
            const kvq_sink *k = &ls->sinks[i];
            if (k->pos == 0 && k->sample == 0) {
                found0 = true;
                ck_assert_msg(fabs(k->share - share0) < 1e-6, "share %g vs %g", k->share, share0);
                ck_assert_int_eq(k->token, 1);
            }
            if (k->pos == SY_PIVOT) {
                found_piv = true;
                ck_assert_int_eq(k->sample, 1);
                ck_assert_int_eq(k->token, 1000 + SY_PIVOT);
                double ref = 0; /* received by the pivot / (L - pivot) */
                for (int q = SY_PIVOT; q < SY_L; q++) ref += q - 1 == 0 ? 0.6 : 0.3;
                ck_assert_msg(fabs(k->share - ref / (SY_L - SY_PIVOT)) < 1e-6, "pivot share %g", k->share);
            }
        }
        ck_assert(found0);
        ck_assert_msg(found_piv == (j >= 2), "layer %d pivot found %d", j, found_piv);
        /* the received mass sums to L per head (mean over samples) */
        double tot = 0;
        for (int i = 0; i < SY_H * SY_L; i++) tot += ls->attn_recv[i];
        ck_assert(fabs(tot - SY_H * SY_L) < 1e-3);
    }
    /* pivots: position 0 of every sample in all 4 layers; the planted pivot in 2 */
    ck_assert(s->n_pivots == SY_N + 1);
    ck_assert_int_eq(s->pivots[0].n_layers, SY_NL);
    ck_assert_int_eq(s->pivots[0].pos, 0);
    ck_assert_int_eq(s->pivots[SY_N].pos, SY_PIVOT);
    ck_assert_int_eq(s->pivots[SY_N].n_layers, 2);
    ck_assert_int_eq(s->pivots[SY_N].token, 1000 + SY_PIVOT);
    /* a stricter multiple drops the 5x channel, keeps the ~10x one */
    kvq_kvstats_free(s);
    o.outlier_mult = 7;
    ck_assert(kvq_kvstats_compute(&y.src, &o, &s, &e) == KVQ_OK);
    ck_assert_int_eq(s->layers[0].t[0].n_outliers, 1);
    kvq_kvstats_free(s);
    synth_free(&y);
}
END_TEST

START_TEST(test_chunking_does_not_change_results)
{
    synth_t y;
    ck_assert(synth_init(&y, 1, 0) == 0);
    kvq_kvstats_opts o = kvq_kvstats_opts_default();
    o.quiet = true;
    kvq_kvstats *a, *b;
    kvq_err e = {0};
    o.chunk_tokens = 1;
    ck_assert(kvq_kvstats_compute(&y.src, &o, &a, &e) == KVQ_OK);
    o.chunk_tokens = 1000;
    ck_assert(kvq_kvstats_compute(&y.src, &o, &b, &e) == KVQ_OK);
    for (int j = 0; j < SY_NL; j++)
        for (int t = 0; t < 3; t++)
            for (int c = 0; c < SY_KV; c++) {
                const kvq_chan_stats *x = &a->layers[j].t[t].chan[c], *z = &b->layers[j].t[t].chan[c];
                ck_assert(x->absmax == z->absmax && x->p99 == z->p99 && x->p999 == z->p999);
                ck_assert(rel_close(x->kurtosis, z->kurtosis, 1e-11) && rel_close(x->std, z->std, 1e-12));
            }
    kvq_kvstats_free(a);
    kvq_kvstats_free(b);
    synth_free(&y);
}
END_TEST

START_TEST(test_bad_input)
{
    synth_t y;
    ck_assert(synth_init(&y, 0, 0) == 0);
    kvq_kvstats_opts o = kvq_kvstats_opts_default();
    o.quiet = true;
    kvq_kvstats *s;
    kvq_err e = {0};
    /* NaN: located */
    y.t[KVQ_KVT_V][2][((size_t)1 * SY_L + 7) * SY_KV + 20] = NAN;
    ck_assert(kvq_kvstats_compute(&y.src, &o, &s, &e) == KVQ_ENUMERIC);
    ck_assert_msg(strstr(e.msg, "layer 2 v: sample 1, position 7, head 1, channel 4"), "%s", e.msg);
    ck_assert(s == NULL);
    y.t[KVQ_KVT_V][2][((size_t)1 * SY_L + 7) * SY_KV + 20] = 0;
    /* bad options */
    o.outlier_mult = 0;
    ck_assert(kvq_kvstats_compute(&y.src, &o, &s, &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "outlier multiple"), "%s", e.msg);
    o = kvq_kvstats_opts_default();
    o.quiet = true;
    /* layer / head / sample that do not exist */
    float buf[SY_L * SY_D];
    ck_assert(kvq_kvsrc_read_head(&y.src, 4, KVQ_KVT_K, 0, 0, buf, &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layer 4 is not in the dump (layers 0..3)"), "%s", e.msg);
    ck_assert(kvq_kvsrc_read_head(&y.src, 0, KVQ_KVT_K, 0, 2, buf, &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "KV head 2 does not exist"), "%s", e.msg);
    ck_assert(kvq_kvsrc_read_head(&y.src, 0, KVQ_KVT_K, 3, 0, buf, &e) == KVQ_EINVAL);
    /* read_head returns the right column block */
    ck_assert(kvq_kvsrc_read_head(&y.src, 1, KVQ_KVT_K_PRE_ROPE, 2, 1, buf, &e) == KVQ_OK);
    ck_assert(buf[5 * SY_D + 3] == y.t[KVQ_KVT_K_PRE_ROPE][1][((size_t)2 * SY_L + 5) * SY_KV + SY_D + 3]);
    /* without attention: stats fine, attention absent */
    ck_assert(kvq_kvstats_compute(&y.src, &o, &s, &e) == KVQ_OK);
    ck_assert(!s->has_attn && s->layers[0].attn_recv == NULL && s->layers[0].top_pos == -1 && s->n_pivots == 0);
    kvq_kvstats_free(s);
    synth_free(&y);
}
END_TEST

/* quantization error of plain schemes: MSE equals a direct float64 computation, Fisher weighting scales it */
START_TEST(test_qerr_plain_schemes)
{
    synth_t y;
    ck_assert(synth_init(&y, 0, 1) == 0);
    kvq_err e = {0};
    kvq_scheme sc[3] = {{.fam = KVQ_FAM("int"), .k_bits = 2, .v_bits = 2},
                        {.fam = KVQ_FAM("int"), .k_bits = 4, .v_bits = 4},
                        {.fam = KVQ_FAM("int"), .k_bits = 8, .v_bits = 8}};
    kvq_qscheme_state st[3];
    kvq_qscheme q[3];
    for (int i = 0; i < 3; i++) ck_assert_msg(kvq_qscheme_plain(&sc[i], SY_D, &st[i], &q[i], &e) == KVQ_OK, "%s", e.msg);
    q[1].keys_post_rope = false; /* pre-RoPE keys: Fisher applies */
    kvq_qerr r;
    ck_assert_msg(kvq_qerr_compute(&y.src, q, 3, true, &r, &e) == KVQ_OK, "%s", e.msg);
    enum { M = SY_N * SY_L * SY_KV };
    float *out = malloc(M * sizeof(float));
    for (int j = 0; j < SY_NL; j++) {
        ck_assert(r.mse_k[0 * SY_NL + j] > r.mse_k[1 * SY_NL + j] && r.mse_k[1 * SY_NL + j] > r.mse_k[2 * SY_NL + j]);
        ck_assert(r.mse_v[0 * SY_NL + j] > r.mse_v[1 * SY_NL + j] && r.mse_v[1 * SY_NL + j] > r.mse_v[2 * SY_NL + j]);
        /* reference for int4 on pre-RoPE keys and values: the primitive applied to all rows at once */
        kvq_quant_counts c = {0};
        for (int w = 0; w < 2; w++) {
            const float *in = y.t[w ? KVQ_KVT_V : KVQ_KVT_K_PRE_ROPE][j];
            ck_assert(kvq_quant_int_token(out, in, (size_t)SY_N * SY_L, SY_KV, 0, 4, 0, &c, &e) == KVQ_OK);
            double ss = 0;
            for (int i = 0; i < M; i++) { double d = (double)in[i] - out[i]; ss += d * d; }
            double got = w ? r.mse_v[SY_NL + j] : r.mse_k[SY_NL + j];
            ck_assert_msg(rel_close(got, ss / M, 1e-12), "mse %g vs %g", got, ss / M);
            double fw = w ? r.fw_v[SY_NL + j] : r.fw_k[SY_NL + j];
            ck_assert(rel_close(fw, (w ? 0.5 : 2.0) * ss / M, 1e-12));
        }
        ck_assert(isnan(r.fw_k[j])); /* post-RoPE keys: no Fisher of k in the dump */
        ck_assert(isnan(r.calib_k[j]));
        ck_assert(r.outl_k[j] == 0);
    }
    free(out);
    /* Fisher weights that are NaN or negative: an error naming the place, as kvcalib gives (the
     * weighted columns silently became "-" or another number, exit 0) */
    for (int bad = 0; bad < 2; bad++) {
        float *f = y.t[bad ? KVQ_KVT_FISHER_K_PRE_ROPE : KVQ_KVT_FISHER_V][1];
        const size_t at = ((size_t)2 * SY_L + 5) * SY_KV + SY_D + 3; /* sample 2, position 5, head 1, channel 3 */
        const float keep = f[at];
        f[at] = bad ? -1.0f : NAN;
        kvq_qerr r2;
        ck_assert(kvq_qerr_compute(&y.src, q, 3, true, &r2, &e) == KVQ_ENUMERIC);
        ck_assert_msg(strstr(e.msg, bad ? "layer 1 fisher_k_pre_rope: sample 2, position 5, head 1, channel 3: value -1 is negative"
                                        : "layer 1 fisher_v: sample 2, position 5, head 1, channel 3: value nan is not finite"),
                      "%s", e.msg);
        f[at] = keep;
    }
    kvq_qerr_free(&r);
    for (int i = 0; i < 3; i++) kvq_qscheme_state_free(&st[i]);
    synth_free(&y);
}
END_TEST

START_TEST(test_normhist)
{
    synth_t y;
    ck_assert(synth_init(&y, 0, 0) == 0);
    kvq_err e = {0};
    float lo[SY_KV], hi[SY_KV];
    for (int c = 0; c < SY_KV; c++) { lo[c] = INFINITY; hi[c] = -INFINITY; }
    const float *kp = y.t[KVQ_KVT_K_PRE_ROPE][3];
    for (int i = 0; i < SY_N * SY_L; i++)
        for (int c = 0; c < SY_KV; c++) { lo[c] = fminf(lo[c], kp[i * SY_KV + c]); hi[c] = fmaxf(hi[c], kp[i * SY_KV + c]); }
    for (int c = 0; c < SY_KV; c++) { float m = (lo[c] + hi[c]) / 2, h = (hi[c] - lo[c]) / 2; lo[c] = m - h / 2; hi[c] = m + h / 2; } /* half range */
    enum { B = 40 };
    uint64_t cnt[B] = {0}, under = 0, over = 0;
    ck_assert_msg(kvq_normhist_layer(&y.src, 3, KVQ_KVT_K_PRE_ROPE, lo, hi, 0, -1, 1, B, cnt, &under, &over, &e) == KVQ_OK, "%s", e.msg);
    uint64_t tot = under + over;
    for (int b = 0; b < B; b++) tot += cnt[b];
    ck_assert_uint_eq(tot, (uint64_t)SY_N * SY_L * SY_KV);
    /* reference: x_n = (x - zp) / r in double; outside [-1, 1] = the sparse outliers of these thresholds */
    uint64_t ref_under = 0, ref_over = 0, ref_mid = 0;
    for (int i = 0; i < SY_N * SY_L; i++)
        for (int c = 0; c < SY_KV; c++) {
            double U = hi[c], Lo = lo[c];
            double xn = ((double)kp[i * SY_KV + c] - (U + Lo) / 2) / ((U - Lo) / 2);
            ref_under += xn < -1;
            ref_over += xn > 1;
            ref_mid += xn >= 0 && xn < 0.05;
        }
    ck_assert_uint_eq(under, ref_under);
    ck_assert_uint_eq(over, ref_over);
    ck_assert_uint_eq(cnt[B / 2], ref_mid);
    ck_assert(under > 0 && over > 0); /* half-range thresholds leave both tails outside */
    /* values: per-token min/max normalisation puts every value in [-1, 1] */
    memset(cnt, 0, sizeof cnt);
    under = over = 0;
    ck_assert(kvq_normhist_layer(&y.src, 0, KVQ_KVT_V, NULL, NULL, 0, -1, 1, B, cnt, &under, &over, &e) == KVQ_OK);
    ck_assert(under == 0 && over == 0);
    ck_assert_uint_eq(cnt[0] > 0 && cnt[B - 1] > 0, 1); /* the min and max of each token */
    ck_assert(kvq_normhist_layer(&y.src, 9, KVQ_KVT_V, NULL, NULL, 0, -1, 1, B, cnt, &under, &over, &e) == KVQ_EINVAL);
    synth_free(&y);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvstats");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_moments_merge_equals_one_pass);
    tcase_add_test(tc, test_sketch_quantiles_within_alpha);
    tcase_add_test(tc, test_stats_match_float64_reference);
    tcase_add_test(tc, test_outliers_spread_sinks);
    tcase_add_test(tc, test_chunking_does_not_change_results);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_qerr_plain_schemes);
    tcase_add_test(tc, test_normhist);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
