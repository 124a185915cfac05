/* bench_calib.c — time to fit one nuq3-1% (layer, K) and (layer, V) table on
 * synthetic data the size of the default model's per-layer dump at 16 x 2048
 * tokens (SmolLM2-135M: 3 KV heads x head_dim 64 = 192 channels), with Fisher
 * weights. Prints seconds for the thresholds, the key table with each fit
 * method, the value table, and Lloyd's k-means and the exact solver alone
 * on this layer's normalised key points (incl. histogram and objective
 * evaluation on all points), then
 * extrapolates to the 30-layer model. Target (issue 6): <= 60 s for the whole
 * model on 2 cores, i.e. about 1 s per layer for K + V.
 * Usage: bench_calib [n_tokens] (default 32768). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kmeans.h"
#include "tables.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rs = 0x1234567ull;
static double unif(void)
{
    rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
    return ((double)(rs >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static double gauss(void) { return sqrt(-2 * log(unif())) * cos(6.283185307179586 * unif()); }

int main(int argc, char **argv)
{
    size_t n_tokens = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : 32768;
    const size_t heads = 3, hd = 64, kv_dim = heads * hd, n = n_tokens * kv_dim;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v), *f = malloc(n * sizeof *f);
    if (!k || !v || !f) return 1;
    double *scale = malloc(kv_dim * sizeof *scale), *off = malloc(kv_dim * sizeof *off);
    for (size_t c = 0; c < kv_dim; c++) { scale[c] = exp(gauss()); off[c] = gauss(); }
    for (size_t t = 0; t < n_tokens; t++)
        for (size_t c = 0; c < kv_dim; c++) {
            double g = gauss(), tail = gauss() / (0.3 + fabs(gauss())); /* heavy-tailed, key-like */
            k[t * kv_dim + c] = (float)(off[c] + scale[c] * (unif() < 0.9 ? g : tail));
            v[t * kv_dim + c] = (float)(0.5 * gauss() + (unif() < 0.01 ? 8 * gauss() : 0));
            double gr = gauss() * 1e-3;
            f[t * kv_dim + c] = (float)(gr * gr);
        }
    for (size_t c = 0; c < kv_dim; c++) k[c] = v[c] = 500.0f; /* attention-sink token, excluded */

    kvq_calib_opts o = {.bits = 3, .outlier_frac = 0.01, .n_sink = 1, .sample_len = 2048,
                        .n_kv_heads = heads, .head_dim = hd};
    kvq_err e = {0};
    printf("synthetic layer: %zu tokens x %zu channels, nuq3-1%%, Fisher-weighted, sink 1 per 2048\n", n_tokens, kv_dim);

    float *lo = malloc(kv_dim * sizeof *lo), *hi = malloc(kv_dim * sizeof *hi);
    double t0 = now();
    if (kvq_calib_key_thresholds(k, n_tokens, &o, lo, hi, NULL, NULL, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
    double t_thr = now() - t0;
    printf("key thresholds (percentiles, %zu channels): %.3f s\n", kv_dim, t_thr);

    double t_meth[3] = {0};
    kvq_kv_table tk[3], tv;
    const char *names[3] = {"auto (both)", "lloyd", "exact"};
    for (int m = 2; m >= 0; m--) {
        o.fit.method = (kvq_fit_method)m;
        t0 = now();
        if (kvq_calib_keys(k, f, n_tokens, &o, &tk[m], &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
        t_meth[m] = now() - t0;
        printf("keys table, fit %-11s: %.3f s  (objective lloyd %.6g, exact %.6g)\n", names[m], t_meth[m],
               tk[m].obj_lloyd[0], tk[m].obj_exact[0]);
    }
    o.fit.method = KVQ_FIT_AUTO;
    t0 = now();
    if (kvq_calib_values(v, f, n_tokens, &o, &tv, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
    double t_v = now() - t0;
    printf("values table, fit auto       : %.3f s  (objective lloyd %.6g, exact %.6g)\n", t_v, tv.obj_lloyd[0],
           tv.obj_exact[0]);
    /* the solvers alone, on the normalised inlier key points of this layer */
    {
        size_t np = 0;
        float *px = malloc(n * sizeof *px), *pw = malloc(n * sizeof *pw);
        for (size_t t = 0; t < n_tokens; t++) {
            if (t % 2048 == 0) continue;
            for (size_t c = 0; c < kv_dim; c++) {
                float x = k[t * kv_dim + c], l = tk[0].channel_lower[c], u = tk[0].channel_upper[c];
                if (x < l || x > u || u == l) continue;
                double xn = ((double)x - 0.5 * ((double)u + l)) / (0.5 * ((double)u - l));
                px[np] = (float)(xn > 1 ? 1 : xn < -1 ? -1 : xn);
                pw[np++] = f[t * kv_dim + c];
            }
        }
        for (int m = 1; m <= 2; m++) {
            kvq_kmeans_opts ko = {.method = (kvq_fit_method)m};
            kvq_kmeans_info info;
            float lv[8];
            t0 = now();
            if (kvq_kmeans1d(px, pw, np, 8, &ko, lv, &info, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
            double dt = now() - t0;
            printf("kvq_kmeans1d %-5s on %zu points (%zu histogram atoms): %.3f s, objective %.6g%s\n", names[m], np,
                   info.n_atoms, dt, m == 1 ? info.obj_lloyd : info.obj_exact,
                   m == 1 ? (info.lloyd_converged ? ", converged" : ", hit max_iter") : "");
            if (m == 1) printf("  (Lloyd: %d iterations)\n", info.lloyd_iters);
        }
        free(px);
        free(pw);
    }
    double per_layer = t_meth[0] + t_v;
    printf("per layer K+V (auto): %.3f s -> 30 layers: %.1f s single-threaded (target <= 60 s)\n", per_layer,
           30 * per_layer);
    for (int m = 0; m < 3; m++) kvq_kv_table_free(&tk[m]);
    kvq_kv_table_free(&tv);
    free(k); free(v); free(f); free(scale); free(off); free(lo); free(hi);
    return 0;
}
