/* vq.c — nearest codeword and weighted c-dimensional k-means; see vq.h. */
#include "vq.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void kvq_vq_transpose(float *cbt, const float *cb, size_t K, size_t c)
{
    for (size_t k = 0; k < K; k++)
        for (size_t d = 0; d < c; d++) cbt[d * K + k] = cb[k * c + d];
}

/* AVX2 where the CPU has it (no FMA: the same float results as the baseline build) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
size_t kvq_vq_nearest_t(const float *x, const float *cbt, size_t K, size_t c, float *dist)
{
    {
        const float *row = cbt;
        float x0 = x[0];
#pragma omp simd
        for (size_t k = 0; k < K; k++) {
            float e = x0 - row[k];
            dist[k] = e * e;
        }
    }
    for (size_t d = 1; d < c; d++) {
        const float *row = cbt + d * K;
        float xd = x[d];
#pragma omp simd
        for (size_t k = 0; k < K; k++) {
            float e = xd - row[k];
            dist[k] += e * e;
        }
    }
    float m = dist[0];
#pragma omp simd reduction(min : m)
    for (size_t k = 1; k < K; k++) m = dist[k] < m ? dist[k] : m;
    for (size_t k = 0; k < K; k++) /* the lowest index of the minimum */
        if (dist[k] == m) return k;
    return 0; /* not reached: the minimum is one of the distances */
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double unif(uint64_t *s) { return ((double)(splitmix(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

/* index i with prefix sums of p reaching u * total (p >= 0, total > 0) */
static size_t sample(const double *p, size_t n, double total, uint64_t *s)
{
    double u = unif(s) * total, acc = 0;
    size_t last = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] <= 0) continue;
        acc += p[i];
        last = i;
        if (acc >= u) return i;
    }
    return last;
}

/* out[i] = sum_d (xt[d][i] - y[d])^2 for the points TRANSPOSED, xt[c][n] (the seeding's distances) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
static void dist_all(const float *xt, size_t n, size_t c, const float *y, float *out)
{
    for (size_t d = 0; d < c; d++) {
        const float *row = xt + d * n;
        float yd = y[d];
        if (d == 0) {
#pragma omp simd
            for (size_t i = 0; i < n; i++) {
                float e = row[i] - yd;
                out[i] = e * e;
            }
        } else {
#pragma omp simd
            for (size_t i = 0; i < n; i++) {
                float e = row[i] - yd;
                out[i] += e * e;
            }
        }
    }
}

kvq_status kvq_vq_kmeans(const float *x, const float *w, size_t n, size_t c, size_t K, const kvq_vq_opts *o, float *cb,
                         kvq_vq_report *rep, kvq_err *err)
{
    if (rep) memset(rep, 0, sizeof *rep);
    if (!x || !cb) return kvq_fail(err, KVQ_EINVAL, "vq k-means: NULL points or codebook");
    if (n == 0) return kvq_fail(err, KVQ_EINVAL, "vq k-means: no points");
    if (K < 1 || K > KVQ_VQ_MAX_K) return kvq_fail(err, KVQ_EINVAL, "vq k-means: codewords: expected 1..%d, found %zu", KVQ_VQ_MAX_K, K);
    if (c < 1 || c > KVQ_VQ_MAX_DIM)
        return kvq_fail(err, KVQ_EINVAL, "vq k-means: dimensions: expected 1..%d, found %zu", KVQ_VQ_MAX_DIM, c);
    double wsum = 0;
    for (size_t i = 0; i < n; i++) {
        double wi = w ? (double)w[i] : 1.0;
        if (!(wi >= 0) || !isfinite(wi))
            return kvq_fail(err, KVQ_EINVAL, "vq k-means: weight of point %zu: expected finite >= 0, found %g", i, wi);
        wsum += wi;
    }
    if (!(wsum > 0)) return kvq_fail(err, KVQ_EINVAL, "vq k-means: all %zu points have weight 0", n);
    int max_iter = o && o->max_iter > 0 ? o->max_iter : 20;
    uint64_t seed = o ? o->seed : 0;
    double *p = malloc(n * sizeof *p), *sum = malloc(K * c * sizeof *sum), *sw = malloc(K * sizeof *sw);
    float *cbt = malloc(K * c * sizeof *cbt), *dist = malloc(K * sizeof *dist), *xt = malloc(n * c * sizeof *xt),
          *dn = malloc(n * sizeof *dn);
    uint32_t *as = malloc(n * sizeof *as);
    if (!p || !sum || !sw || !cbt || !dist || !as || !xt || !dn) {
        free(xt);
        free(dn);
        free(p);
        free(sum);
        free(sw);
        free(cbt);
        free(dist);
        free(as);
        return kvq_fail(err, KVQ_ENOMEM, "vq k-means: out of memory (%zu points, %zu codewords)", n, K);
    }
    /* k-means++: the first centre by weight, then D^2 * w */
    for (size_t i = 0; i < n; i++) p[i] = w ? (double)w[i] : 1.0;
    size_t first = sample(p, n, wsum, &seed);
    memcpy(cb, x + first * c, c * sizeof *cb);
    for (size_t i = 0; i < n; i++)
        for (size_t d = 0; d < c; d++) xt[d * n + i] = x[i * c + d];
    dist_all(xt, n, c, cb, dn);
    double tot = 0;
    for (size_t i = 0; i < n; i++) {
        p[i] = (w ? (double)w[i] : 1.0) * (double)dn[i];
        tot += p[i];
    }
    for (size_t k = 1; k < K; k++) {
        float *ck = cb + k * c;
        if (tot > 0) memcpy(ck, x + sample(p, n, tot, &seed) * c, c * sizeof *ck);
        else memcpy(ck, cb, c * sizeof *ck); /* every weighted point is a centre already: repeat the first */
        dist_all(xt, n, c, ck, dn);
        tot = 0;
        for (size_t i = 0; i < n; i++) {
            double d = (w ? (double)w[i] : 1.0) * (double)dn[i];
            if (d < p[i]) p[i] = d;
            tot += p[i];
        }
    }
    /* Lloyd */
    double J = 0;
    int it = 0;
    for (;;) {
        kvq_vq_transpose(cbt, cb, K, c);
        size_t changed = 0;
        J = 0;
        for (size_t i = 0; i < n; i++) {
            uint32_t a = (uint32_t)kvq_vq_nearest_t(x + i * c, cbt, K, c, dist);
            if (it == 0 || a != as[i]) changed++;
            as[i] = a;
            J += (w ? (double)w[i] : 1.0) * (double)dist[a];
        }
        if (changed * 1000 <= n || it == max_iter) break; /* converged: at most 0.1% of the points moved */
        memset(sum, 0, K * c * sizeof *sum);
        memset(sw, 0, K * sizeof *sw);
        for (size_t i = 0; i < n; i++) {
            double wi = w ? (double)w[i] : 1.0;
            if (wi <= 0) continue;
            sw[as[i]] += wi;
            for (size_t d = 0; d < c; d++) sum[as[i] * c + d] += wi * (double)x[i * c + d];
        }
        for (size_t k = 0; k < K; k++)
            if (sw[k] > 0)
                for (size_t d = 0; d < c; d++) cb[k * c + d] = (float)(sum[k * c + d] / sw[k]);
        it++;
    }
    if (rep) {
        memset(sw, 0, K * sizeof *sw);
        for (size_t i = 0; i < n; i++)
            if (!w || w[i] > 0) sw[as[i]] = 1;
        for (size_t k = 0; k < K; k++) rep->n_used += sw[k] > 0;
        rep->objective = J;
        rep->iterations = it;
    }
    free(xt);
    free(dn);
    free(p);
    free(sum);
    free(sw);
    free(cbt);
    free(dist);
    free(as);
    return KVQ_OK;
}
