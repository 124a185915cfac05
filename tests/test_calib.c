/* test_calib.c — weighted 1-D k-means (Lloyd and the exact DP) and the
 * calibration table builder: known centres recovered on synthetic mixtures,
 * exact objective optimal (brute force over all partitions of a small set)
 * and <= Lloyd's on heavy-tailed key-like data, Fisher weights pulling
 * levels, percentile thresholds against a sort-based numpy-linear reference
 * and the requested fraction outside per channel, sink exclusion, NaN / bad
 * option errors, and consistency of the fitted objective with the quantizer. */
#include <math.h>
#include <stdint.h>

#include "kmeans.h"
#include "kvq_test.h"
#include "quant.h"
#include "tables.h"

static uint64_t rng_state;
static double unif(void)
{
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return ((double)(rng_state >> 11) + 0.5) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2 * log(unif())) * cos(6.283185307179586 * unif()); }

/* heavy-tailed (Student-t-like) values squashed into [-1, 1], like normalised keys */
static float heavy(void)
{
    double v = gauss() / (0.35 + fabs(gauss()));
    return (float)tanh(0.4 * v);
}

START_TEST(test_recover_centres)
{
    const double truth[4] = {-0.8, -0.2, 0.3, 0.9};
    const size_t n = kvq_test_quick() ? 4000 : 20000;
    float *x = malloc(n * sizeof *x);
    rng_state = 21;
    for (size_t i = 0; i < n; i++) x[i] = (float)(truth[i % 4] + 0.02 * gauss());
    kvq_err e = {0};
    size_t bins[2] = {65536, 1024}; /* exact mode (n <= bins) and histogram mode */
    for (int b = 0; b < 2; b++)
        for (int m = KVQ_FIT_LLOYD; m <= KVQ_FIT_EXACT; m++) {
            kvq_kmeans_opts o = {.method = (kvq_fit_method)m, .n_bins = bins[b] < n ? bins[b] : n};
            float c[4];
            kvq_kmeans_info info;
            ck_assert_msg(kvq_kmeans1d(x, NULL, n, 4, &o, c, &info, &e) == KVQ_OK, "%s", e.msg);
            ck_assert(info.histogram == (o.n_bins < n));
            for (int j = 0; j < 4; j++)
                ck_assert_msg(fabs(c[j] - truth[j]) < 0.005, "%s bins %zu: centre %d = %g, want %g",
                              kvq_fit_method_name((kvq_fit_method)m), o.n_bins, j, (double)c[j], truth[j]);
            if (m == KVQ_FIT_LLOYD) ck_assert(info.lloyd_converged);
        }
    free(x);
}
END_TEST

/* Brute force: every split of sorted points into k contiguous non-empty runs. */
static double brute_opt(const double *xs, const double *ws, int n, int k, int start)
{
    if (k == 1) {
        double W = 0, S = 0, Q = 0;
        for (int i = start; i < n; i++) { W += ws[i]; S += ws[i] * xs[i]; Q += ws[i] * xs[i] * xs[i]; }
        return Q - S * S / W;
    }
    double best = INFINITY;
    for (int end = start + 1; end <= n - (k - 1); end++) {
        double W = 0, S = 0, Q = 0;
        for (int i = start; i < end; i++) { W += ws[i]; S += ws[i] * xs[i]; Q += ws[i] * xs[i] * xs[i]; }
        double v = Q - S * S / W + brute_opt(xs, ws, n, k - 1, end);
        if (v < best) best = v;
    }
    return best;
}

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

START_TEST(test_exact_is_optimal)
{
    rng_state = 22;
    for (int rep = 0; rep < 30; rep++) {
        int n = 9 + rep % 6, k = 2 + rep % 4;
        float x[16], w[16];
        double xs[16], ws[16];
        for (int i = 0; i < n; i++) x[i] = heavy();
        qsort(x, (size_t)n, sizeof *x, cmp_f);
        for (int i = 0; i < n; i++) { w[i] = (float)(0.1 + unif() * 3); xs[i] = x[i]; ws[i] = w[i]; }
        float c[8];
        kvq_kmeans_info info;
        kvq_kmeans_opts o = {.method = KVQ_FIT_AUTO};
        kvq_err e = {0};
        ck_assert_msg(kvq_kmeans1d(x, w, (size_t)n, k, &o, c, &info, &e) == KVQ_OK, "%s", e.msg);
        double opt = brute_opt(xs, ws, n, k, 0);
        ck_assert_msg(fabs(info.obj_exact - opt) <= 1e-6 * (opt + 1e-12) + 1e-9, "rep %d: exact %.12g vs brute %.12g",
                      rep, info.obj_exact, opt);
        ck_assert(info.obj_exact <= info.obj_lloyd + 1e-9 * opt);
        for (int j = 1; j < k; j++) ck_assert(c[j] >= c[j - 1]);
    }
}
END_TEST

START_TEST(test_exact_le_lloyd_heavy_tailed)
{
    const size_t n = kvq_test_quick() ? 3000 : 12000;
    float *x = malloc(n * sizeof *x), *w = malloc(n * sizeof *w);
    kvq_err e = {0};
    int strict = 0, runs = 0;
    for (int rep = 0; rep < 6; rep++) {
        rng_state = 100 + (uint64_t)rep;
        for (size_t i = 0; i < n; i++) {
            x[i] = heavy();
            double g = gauss();
            w[i] = (float)(g * g);
        }
        for (int bits = 2; bits <= 4; bits++) {
            int k = 1 << bits;
            float c[16];
            kvq_kmeans_info info;
            kvq_kmeans_opts o = {.seed = (uint64_t)rep};
            ck_assert_msg(kvq_kmeans1d(x, rep % 2 ? w : NULL, n, k, &o, c, &info, &e) == KVQ_OK, "%s", e.msg);
            ck_assert(!info.histogram);
            ck_assert_msg(info.obj_exact <= info.obj_lloyd * (1 + 1e-12), "rep %d bits %d: exact %.10g > lloyd %.10g", rep,
                          bits, info.obj_exact, info.obj_lloyd);
            ck_assert(info.chosen == KVQ_FIT_EXACT);
            /* reported objective is J on the points */
            ck_assert_double_eq_tol(info.obj_exact, kvq_kmeans1d_objective(x, rep % 2 ? w : NULL, n, c, k),
                                    1e-9 * info.obj_exact);
            strict += info.obj_exact < info.obj_lloyd * (1 - 1e-9);
            runs++;
        }
    }
    fprintf(stderr, "exact strictly better than Lloyd in %d of %d heavy-tailed fits\n", strict, runs);
    free(x);
    free(w);
}
END_TEST

START_TEST(test_fisher_pulls_levels)
{
    const size_t n = 4000;
    float *x = malloc(n * sizeof *x), *w = malloc(n * sizeof *w);
    rng_state = 23;
    for (size_t i = 0; i < n; i++) {
        x[i] = (float)(2 * unif() - 1);
        w[i] = (x[i] > 0.5f && x[i] < 0.6f) ? 200.0f : 1.0f;
    }
    kvq_err e = {0};
    float cu[4], cw[4];
    kvq_kmeans_info iu, iw;
    ck_assert(kvq_kmeans1d(x, NULL, n, 4, NULL, cu, &iu, &e) == KVQ_OK);
    ck_assert(kvq_kmeans1d(x, w, n, 4, NULL, cw, &iw, &e) == KVQ_OK);
    double du = 1, dw = 1;
    int nu = 0, nw = 0;
    for (int j = 0; j < 4; j++) {
        du = fmin(du, fabs(cu[j] - 0.55));
        dw = fmin(dw, fabs(cw[j] - 0.55));
        nu += cu[j] > 0.3f;
        nw += cw[j] > 0.3f;
    }
    /* unweighted on uniform [-1,1]: levels near -0.75, -0.25, 0.25, 0.75 */
    ck_assert_msg(fabs(cu[3] - 0.75) < 0.05, "unweighted top level %g", (double)cu[3]);
    ck_assert_msg(dw < 0.02 && dw < du / 4, "weighted nearest level to 0.55 at distance %g (unweighted %g)", dw, du);
    ck_assert_int_ge(nw, nu);
    /* the weighted fit is better under the weighted criterion, worse unweighted */
    ck_assert(kvq_kmeans1d_objective(x, w, n, cw, 4) < kvq_kmeans1d_objective(x, w, n, cu, 4));
    ck_assert(kvq_kmeans1d_objective(x, NULL, n, cu, 4) < kvq_kmeans1d_objective(x, NULL, n, cw, 4));
    free(x);
    free(w);
}
END_TEST

START_TEST(test_kmeans_degenerate_and_errors)
{
    kvq_err e = {0};
    float c[8];
    kvq_kmeans_info info;
    float one[5] = {0.3f, 0.3f, 0.3f, 0.3f, 0.3f};
    ck_assert(kvq_kmeans1d(one, NULL, 5, 8, NULL, c, &info, &e) == KVQ_OK);
    for (int j = 0; j < 8; j++) ck_assert_float_eq(c[j], 0.3f);
    ck_assert_double_eq(info.obj_exact, 0);
    float three[6] = {-1, -1, 0, 0, 1, 1};
    ck_assert(kvq_kmeans1d(three, NULL, 6, 4, NULL, c, &info, &e) == KVQ_OK);
    ck_assert_float_eq(c[0], -1); ck_assert_float_eq(c[3], 1);
    for (int j = 1; j < 4; j++) ck_assert(c[j] > c[j - 1]);
    ck_assert_double_eq(info.obj_exact, 0);
    float nan[3] = {0, NAN, 1};
    ck_assert(kvq_kmeans1d(nan, NULL, 3, 2, NULL, c, &info, &e) == KVQ_ENUMERIC);
    ck_assert_ptr_nonnull(strstr(e.msg, "point 1"));
    float w[3] = {1, -1, 1}, x3[3] = {0, 1, 2};
    ck_assert(kvq_kmeans1d(x3, w, 3, 2, NULL, c, &info, &e) == KVQ_ENUMERIC);
    ck_assert_ptr_nonnull(strstr(e.msg, "weight 1"));
    float w0[3] = {0, 0, 0};
    ck_assert(kvq_kmeans1d(x3, w0, 3, 2, NULL, c, &info, &e) == KVQ_ENUMERIC);
    ck_assert_ptr_nonnull(strstr(e.msg, "total weight"));
    ck_assert(kvq_kmeans1d(x3, NULL, 3, 0, NULL, c, &info, &e) == KVQ_EINVAL);
}
END_TEST

/* ---- thresholds and tables ---------------------------------------------------------- */

/* numpy 'linear' percentile by full sort (independent of the selection code) */
static float np_percentile(const float *col, size_t n, double q)
{
    float *s = malloc(n * sizeof *s);
    memcpy(s, col, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_f);
    double pos = q * (double)(n - 1);
    size_t i = (size_t)floor(pos);
    double g = pos - (double)i, v;
    if (i + 1 >= n) v = s[n - 1];
    else v = g >= 0.5 ? s[i + 1] - ((double)s[i + 1] - s[i]) * (1 - g) : s[i] + ((double)s[i + 1] - s[i]) * g;
    free(s);
    return (float)v;
}

static void make_keys(float *k, size_t T, size_t D, size_t sample_len)
{
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < D; c++) {
            double v = gauss() / (0.3 + fabs(gauss()));
            k[t * D + c] = (float)((double)c - 3 + (1 + (double)(c % 3)) * v);
            if (sample_len && t % sample_len == 0) k[t * D + c] = 1e6f; /* attention-sink token */
        }
}

START_TEST(test_percentile_thresholds)
{
    const size_t T = 20000, D = 8, SL = 2000;
    float *k = malloc(T * D * sizeof *k), *col = malloc(T * sizeof *col);
    rng_state = 24;
    make_keys(k, T, D, SL);
    kvq_calib_opts o = {.bits = 3, .outlier_frac = 0.01, .n_sink = 1, .sample_len = SL, .n_kv_heads = 2, .head_dim = 4};
    float lo[8], hi[8];
    uint64_t n_out, n_el;
    kvq_err e = {0};
    ck_assert_msg(kvq_calib_key_thresholds(k, T, &o, lo, hi, &n_out, &n_el, &e) == KVQ_OK, "%s", e.msg);
    size_t used = T - T / SL;
    ck_assert_uint_eq(n_el, used * D);
    /* 0.995 * (used - 1) = 19880.005: 19880 below, 99 above the upper threshold, same below the lower */
    size_t want = used - 1 - (size_t)floor(0.995 * (double)(used - 1));
    uint64_t tot = 0;
    for (size_t c = 0; c < D; c++) {
        size_t m = 0, above = 0, below = 0;
        for (size_t t = 0; t < T; t++)
            if (t % SL) col[m++] = k[t * D + c];
        ck_assert_float_eq(hi[c], np_percentile(col, m, 0.995));
        ck_assert_float_eq(lo[c], np_percentile(col, m, 0.005));
        ck_assert(hi[c] < 1e5f); /* sink excluded */
        for (size_t i = 0; i < m; i++) { above += col[i] > hi[c]; below += col[i] < lo[c]; }
        ck_assert_msg(above == want && below == want, "channel %zu: %zu above, %zu below, want %zu (0.5%% of %zu)", c,
                      above, below, want, m);
        tot += above + below;
    }
    ck_assert_uint_eq(n_out, tot);
    /* 0% → min / max of the non-sink tokens */
    o.outlier_frac = 0;
    ck_assert(kvq_calib_key_thresholds(k, T, &o, lo, hi, &n_out, NULL, &e) == KVQ_OK);
    ck_assert_uint_eq(n_out, 0);
    for (size_t c = 0; c < D; c++) {
        float mx = -INFINITY;
        for (size_t t = 0; t < T; t++) if (t % SL) mx = fmaxf(mx, k[t * D + c]);
        ck_assert_float_eq(hi[c], mx);
    }
    free(k);
    free(col);
}
END_TEST

START_TEST(test_tables_keys_values)
{
    const size_t T = kvq_test_quick() ? 1024 : 4096, H = 2, HD = 8, D = H * HD, SL = 512;
    float *k = malloc(T * D * sizeof *k), *v = malloc(T * D * sizeof *v), *f = malloc(T * D * sizeof *f);
    float *y = malloc(T * D * sizeof *y);
    rng_state = 25;
    make_keys(k, T, D, SL);
    for (size_t t = 0; t < T; t++) k[t * D + 5] = 2.5f; /* zero-range channel */
    for (size_t i = 0; i < T * D; i++) {
        v[i] = (float)(gauss() + (unif() < 0.02 ? 10 * gauss() : 0));
        double g = gauss();
        f[i] = (float)(g * g * 1e-6);
    }
    for (size_t c = 0; c < D; c++) v[9 * D + c] = 0.75f; /* constant token */
    kvq_calib_opts o = {.bits = 3, .outlier_frac = 0.01, .n_sink = 1, .sample_len = SL, .n_kv_heads = H, .head_dim = HD};
    kvq_err e = {0};
    for (int per_head = 0; per_head < 2; per_head++) {
        o.per_head = per_head;
        kvq_kv_table tk, tv;
        ck_assert_msg(kvq_calib_keys(k, f, T, &o, &tk, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_msg(kvq_calib_values(v, f, T, &o, &tv, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_uint_eq(tk.n_tables, per_head ? H : 1);
        ck_assert_uint_eq(tv.n_tables, per_head ? H : 1);
        for (size_t h = 0; h < tk.n_tables; h++)
            for (int j = 0; j < 8; j++) {
                float a = tk.levels[h * 8 + j], b = tv.levels[h * 8 + j];
                ck_assert(isfinite(a) && a >= -1 && a <= 1 && isfinite(b) && b >= -1 && b <= 1);
                if (j) ck_assert(a >= tk.levels[h * 8 + j - 1] && b >= tv.levels[h * 8 + j - 1]);
            }
        for (size_t h = 0; h < tk.n_tables; h++) {
            ck_assert(tk.obj_exact[h] >= 0 && tk.obj_exact[h] <= tk.obj_lloyd[h] * (1 + 1e-9));
            ck_assert(tv.obj_exact[h] >= 0 && tv.obj_exact[h] <= tv.obj_lloyd[h] * (1 + 1e-9));
            ck_assert(tk.chosen[h] == KVQ_FIT_CHOSEN_EXACT || tk.chosen[h] == KVQ_FIT_CHOSEN_LLOYD);
        }
        ck_assert_float_eq(tk.channel_lower[5], 2.5f);
        ck_assert_float_eq(tk.channel_upper[5], 2.5f);
        /* keys: per channel and side, used-1-floor(0.995 (used-1)) tokens outside (0.5%); channel 5 has none */
        size_t used = T - T / SL, side = used - 1 - (size_t)floor(0.995 * (double)(used - 1));
        ck_assert_uint_eq(tk.n_elems, used * D);
        ck_assert_uint_eq(tk.n_outliers, (D - 1) * 2 * side);
        /* values: 1 per side per token of 16 (kvq_outliers_per_side), none for the constant token */
        ck_assert_uint_eq(tv.n_outliers, 2 * (used - 1));
        /* quantizing the calibration data with the table: same outliers as calibration */
        kvq_nuq_lut lut = {3, tk.n_tables, HD, tk.levels};
        kvq_quant_counts cnt = {0};
        ck_assert(kvq_quant_nuq_keys(y, k, T, D, &lut, tk.channel_lower, tk.channel_upper, true, 0, &cnt, &e) == KVQ_OK);
        uint64_t sink_out = 0;
        for (size_t t = 0; t < T; t += SL)
            for (size_t c = 0; c < D; c++) sink_out += k[t * D + c] > tk.channel_upper[c];
        ck_assert_uint_eq(cnt.n_outliers, tk.n_outliers + sink_out);
        for (size_t i = 0; i < T * D; i++) ck_assert(isfinite(y[i]));
        kvq_kv_table_free(&tk);
        kvq_kv_table_free(&tv);
    }
    free(k); free(v); free(f); free(y);
}
END_TEST

/* Unweighted, the fitted objective equals the normalised-domain squared error of
 * kvq_quant_nuq_keys on the calibration inliers: calibration and quantizer agree. */
START_TEST(test_objective_matches_quantizer)
{
    const size_t T = 2000, D = 6;
    float *k = malloc(T * D * sizeof *k), *y = malloc(T * D * sizeof *y);
    rng_state = 26;
    make_keys(k, T, D, 0);
    kvq_calib_opts o = {.bits = 2, .outlier_frac = 0.02, .n_kv_heads = 1, .head_dim = D};
    kvq_kv_table tk;
    kvq_err e = {0};
    ck_assert(kvq_calib_keys(k, NULL, T, &o, &tk, &e) == KVQ_OK);
    kvq_nuq_lut lut = {2, 1, D, tk.levels};
    ck_assert(kvq_quant_nuq_keys(y, k, T, D, &lut, tk.channel_lower, tk.channel_upper, true, 0, NULL, &e) == KVQ_OK);
    double J = 0;
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < D; c++) {
            double x = k[t * D + c], lo = tk.channel_lower[c], hi = tk.channel_upper[c];
            if (x > hi || x < lo) continue;
            double r = (hi - lo) / 2, d = (y[t * D + c] - x) / r;
            J += d * d;
        }
    double Jt = tk.chosen[0] == KVQ_FIT_CHOSEN_EXACT ? tk.obj_exact[0] : tk.obj_lloyd[0];
    ck_assert_msg(fabs(J - Jt) <= 1e-4 * Jt, "quantizer SSE %.9g vs fitted objective %.9g", J, Jt);
    kvq_kv_table_free(&tk);
    free(k);
    free(y);
}
END_TEST

START_TEST(test_tables_errors)
{
    const size_t T = 64, D = 4;
    float k[256], f[256];
    for (size_t i = 0; i < T * D; i++) { k[i] = (float)i; f[i] = 1; }
    kvq_calib_opts o = {.bits = 3, .outlier_frac = 0.01, .n_kv_heads = 1, .head_dim = 4};
    kvq_kv_table t;
    kvq_err e = {0};
    k[37] = NAN;
    ck_assert(kvq_calib_keys(k, NULL, T, &o, &t, &e) == KVQ_ENUMERIC);
    ck_assert_msg(strstr(e.msg, "token 9, channel 1"), "%s", e.msg);
    k[37] = INFINITY;
    ck_assert(kvq_calib_values(k, NULL, T, &o, &t, &e) == KVQ_ENUMERIC);
    k[37] = 1;
    f[6] = -1;
    ck_assert(kvq_calib_keys(k, f, T, &o, &t, &e) == KVQ_ENUMERIC);
    ck_assert_msg(strstr(e.msg, "Fisher") && strstr(e.msg, "token 1, channel 2"), "%s", e.msg);
    f[6] = 1;
    o.bits = 9;
    ck_assert(kvq_calib_keys(k, f, T, &o, &t, &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "bits: expected 1..8, found 9"), "%s", e.msg);
    o.bits = 0;
    ck_assert(kvq_calib_values(k, f, T, &o, &t, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "bits"));
    o.bits = 3;
    o.outlier_frac = 0.5;
    ck_assert(kvq_calib_keys(k, f, T, &o, &t, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "outlier fraction"));
    o.outlier_frac = -0.01;
    ck_assert(kvq_calib_int_pc_keys(k, T, &o, &t, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "outlier fraction"));
    o.outlier_frac = 0;
    o.n_sink = 70; /* every token is a sink token */
    ck_assert(kvq_calib_keys(k, f, T, &o, &t, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "sink"));
    /* all-zero Fisher weights: nothing to fit; uniform levels, objectives -1 (inspect shows it) */
    o.n_sink = 0;
    memset(f, 0, sizeof f);
    ck_assert(kvq_calib_keys(k, f, T, &o, &t, &e) == KVQ_OK); /* nothing fitted: uniform levels, objectives -1 */
    ck_assert_double_eq(t.obj_exact[0], -1);
    ck_assert_float_eq(t.levels[0], -1);
    ck_assert_float_eq(t.levels[7], 1);
    kvq_kv_table_free(&t);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("calib");
    TCase *tc = tcase_create("kmeans");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_recover_centres);
    tcase_add_test(tc, test_exact_is_optimal);
    tcase_add_test(tc, test_exact_le_lloyd_heavy_tailed);
    tcase_add_test(tc, test_fisher_pulls_levels);
    tcase_add_test(tc, test_kmeans_degenerate_and_errors);
    suite_add_tcase(s, tc);
    TCase *tt = tcase_create("tables");
    tcase_set_timeout(tt, 120);
    tcase_add_test(tt, test_percentile_thresholds);
    tcase_add_test(tt, test_tables_keys_values);
    tcase_add_test(tt, test_objective_matches_quantizer);
    tcase_add_test(tt, test_tables_errors);
    suite_add_tcase(s, tt);
    return s;
}

KVQ_TEST_MAIN(suite)
