/* vq.c — nearest codeword and weighted c-dimensional k-means; see vq.h. */
#include "vq.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define VQ_LANES 16u

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
    /* the lowest index of the minimum: the first block of VQ_LANES holding it, then within the block */
    size_t k0 = 0;
    for (; k0 + VQ_LANES <= K; k0 += VQ_LANES) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (size_t q = 0; q < VQ_LANES; q++) hit |= dist[k0 + q] == m;
        if (hit) break;
    }
    for (size_t k = k0; k < K; k++)
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

/* k-means++ sampling in blocks of VQ_BLOCK points: bs[b] is the sum of p over block b, so a draw scans
 * the blocks and then one block instead of all points */
#define VQ_BLOCK 256

/* bs[b] = the sum of p over block b, in 8 fixed lanes combined in a fixed order (the same double whether
 * or how the loop is vectorised); returns the sum of the blocks in order */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
static double block_sums(const double *p, size_t n, double *bs)
{
    double tot = 0;
    for (size_t b0 = 0, j = 0; b0 < n; b0 += VQ_BLOCK, j++) {
        size_t e = b0 + VQ_BLOCK < n ? b0 + VQ_BLOCK : n, i = b0;
        double l[8] = {0};
        for (; i + 8 <= e; i += 8)
            for (int q = 0; q < 8; q++) l[q] += p[i + q];
        for (; i < e; i++) l[0] += p[i];
        bs[j] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        tot += bs[j];
    }
    return tot;
}

/* the first index i with p[i] > 0 at which the running sum of p reaches u * total (p >= 0, total > 0,
 * bs = block_sums(p)); past the end by rounding: the last i with p[i] > 0 */
static size_t sample(const double *p, const double *bs, size_t n, double total, uint64_t *s)
{
    double u = unif(s) * total, acc = 0;
    size_t nb = (n + VQ_BLOCK - 1) / VQ_BLOCK, b = 0;
    while (b < nb && acc + bs[b] < u) acc += bs[b++];
    for (size_t i = b * VQ_BLOCK; i < n; i++) {
        if (p[i] <= 0) continue;
        acc += p[i];
        if (acc >= u) return i;
    }
    for (size_t i = n; i-- > 0;)
        if (p[i] > 0) return i;
    return 0;
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

/* ---- Lloyd with Hamerly's bounds ----------------------------------------------------
 * Exact: a point is skipped only when a bound proves that the nearest rule (float
 * sums, ties to the lowest index) would keep its codeword, so the assignments, the
 * codebook and J are those of a full search every iteration. Bounds are on true
 * (real-number) distances; a float squared distance fd of c terms satisfies
 * D^2 (1 - g) - a <= fd <= D^2 (1 + g) + a with g = (c + 3) 2^-24 (one rounding per
 * difference, square and addition) and a = c 2^-149 (underflow of the squares).
 * Per point: l = a lower bound of the distance to every other codeword (from the
 * second-nearest at the last full search, minus the largest move of another
 * codeword since); per codeword: s = half the distance to its nearest other
 * codeword. With U = an upper bound of the distance to the assigned codeword (from
 * its float distance, recomputed each iteration), max(l, s) > U proves every other
 * codeword is farther in float too (Hamerly 2010, "Making k-means even faster"). */

#define VQ_G(c) (((double)(c) + 3.0) * 5.9604644775390625e-8 * 1.01)
#define VQ_A(c) ((double)(c) * 1.4012984643e-45 * 2.0)

/* float squared distance in the nearest rule's order (as kvq_vq_nearest_t and dist_all) */
static inline float dist1(const float *x, const float *y, size_t c)
{
    float e = x[0] - y[0], s = e * e;
    for (size_t d = 1; d < c; d++) {
        e = x[d] - y[d];
        s += e * e;
    }
    return s;
}

/* upper bound of the true SQUARED distance given a float squared distance */
static inline double bound_hi2(float fd, size_t c) { return ((double)fd + VQ_A(c)) / (1.0 - VQ_G(c)) * (1.0 + 1e-12); }

/* lower bound of the true distance given a float squared distance (0 for none) */
static inline double bound_lo(float fd, size_t c)
{
    if (!isfinite(fd)) return 0;
    double v = ((double)fd - VQ_A(c)) / (1.0 + VQ_G(c));
    return v > 0 ? sqrt(v) * (1.0 - 1e-12) : 0;
}

/* second-smallest distance of dist[0..K) other than index a (INFINITY if K == 1) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
static float second_min(float *dist, size_t K, size_t a)
{
    float save = dist[a], m = INFINITY;
    dist[a] = INFINITY;
#pragma omp simd reduction(min : m)
    for (size_t k = 0; k < K; k++) m = dist[k] < m ? dist[k] : m;
    dist[a] = save;
    return m;
}

/* One k-means++ step after codeword k with float distances dn: the potential p[i] = min(p[i], w[i] dn[i])
 * (w NULL: 1) and the running nearest (b1, index as) and second-nearest (b2) float distances, strict
 * improvement, so ties keep the lowest index (the nearest rule's). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
static void seed_step(const float *dn, const float *w, size_t n, uint32_t k, double *p, float *b1, float *b2, uint32_t *as)
{
    if (w) {
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            double d = (double)w[i] * (double)dn[i];
            p[i] = d < p[i] ? d : p[i];
        }
    } else {
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            double d = (double)dn[i];
            p[i] = d < p[i] ? d : p[i];
        }
    }
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float f = dn[i], o1 = b1[i], o2 = b2[i];
        int lt = f < o1;
        b2[i] = lt ? o1 : (f < o2 ? f : o2);
        b1[i] = lt ? f : o1;
        as[i] = lt ? k : as[i];
    }
}

/* true distance between two float vectors, rounded up (double) */
static double move_hi(const float *p, const float *q, size_t c)
{
    double s = 0;
    for (size_t d = 0; d < c; d++) {
        double e = (double)p[d] - (double)q[d];
        s += e * e;
    }
    return s > 0 ? sqrt(s) * (1.0 + 1e-12) : 0;
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
    const float *init = o ? o->init : NULL;
    if (init)
        for (size_t j = 0; j < K * c; j++)
            if (!isfinite(init[j]))
                return kvq_fail(err, KVQ_EINVAL, "vq k-means: initial codebook: codeword %zu, dimension %zu is not finite", j / c, j % c);
    bool exhaustive = o && o->exhaustive;
    int max_iter = o && o->max_iter > 0 ? o->max_iter : 20;
    uint64_t seed = o ? o->seed : 0;
    double *p = malloc(n * sizeof *p), *lb = malloc(n * sizeof *lb), *sum = malloc(K * c * sizeof *sum),
           *sw = malloc(K * sizeof *sw), *mv = malloc(K * sizeof *mv), *half = malloc(K * sizeof *half),
           *bs = malloc((n / VQ_BLOCK + 1) * sizeof *bs);
    float *cbt = malloc(K * c * sizeof *cbt), *dist = malloc(K * sizeof *dist), *xt = malloc(n * c * sizeof *xt),
          *dn = malloc(n * sizeof *dn), *b1 = malloc(n * sizeof *b1), *b2 = malloc(n * sizeof *b2), *old = malloc(K * c * sizeof *old);
    uint32_t *as = malloc(n * sizeof *as);
    kvq_status st = KVQ_OK;
    if (!p || !lb || !sum || !sw || !mv || !half || !bs || !cbt || !dist || !xt || !dn || !b1 || !b2 || !old || !as) {
        st = kvq_fail(err, KVQ_ENOMEM, "vq k-means: out of memory (%zu points, %zu codewords)", n, K);
        goto done;
    }
    /* it == 0's assignment: from the seeding's distances (the same floats as the nearest rule, codewords in
     * index order, strict improvement: ties to the lowest index), or by a full search below */
    bool seeded = false;
    if (init) {
        memcpy(cb, init, K * c * sizeof *cb);
    } else {
        /* k-means++: the first centre by weight, then D^2 * w */
        for (size_t i = 0; i < n; i++) p[i] = w ? (double)w[i] : 1.0;
        size_t first = sample(p, bs, n, block_sums(p, n, bs), &seed);
        memcpy(cb, x + first * c, c * sizeof *cb);
        for (size_t i = 0; i < n; i++)
            for (size_t d = 0; d < c; d++) xt[d * n + i] = x[i * c + d];
        dist_all(xt, n, c, cb, dn);
        for (size_t i = 0; i < n; i++) {
            p[i] = (w ? (double)w[i] : 1.0) * (double)dn[i];
            as[i] = 0;
            b1[i] = dn[i];
            b2[i] = INFINITY; /* second-nearest float distance (K == 1: none) */
        }
        double tot = block_sums(p, n, bs);
        for (size_t k = 1; k < K; k++) {
            float *ck = cb + k * c;
            if (tot > 0) memcpy(ck, x + sample(p, bs, n, tot, &seed) * c, c * sizeof *ck);
            else memcpy(ck, cb, c * sizeof *ck); /* every weighted point is a centre already: repeat the first */
            dist_all(xt, n, c, ck, dn);
            seed_step(dn, w, n, (uint32_t)k, p, b1, b2, as);
            tot = block_sums(p, n, bs);
        }
        if (!exhaustive) {
            for (size_t i = 0; i < n; i++) lb[i] = bound_lo(b2[i], c);
            seeded = true;
        }
    }
    /* Lloyd */
    double J = 0;
    int it = 0;
    size_t maxmove_at = 0;
    double maxmove1 = 0, maxmove2 = 0;
    for (;;) {
        kvq_vq_transpose(cbt, cb, K, c);
        size_t changed = 0;
        J = 0;
        if (it == 0 && seeded) {
            for (size_t i = 0; i < n; i++) J += (w ? (double)w[i] : 1.0) * (double)b1[i];
            changed = n;
        } else if (it == 0 || exhaustive) {
            for (size_t i = 0; i < n; i++) {
                uint32_t a = (uint32_t)kvq_vq_nearest_t(x + i * c, cbt, K, c, dist);
                if (it == 0 || a != as[i]) changed++;
                as[i] = a;
                J += (w ? (double)w[i] : 1.0) * (double)dist[a];
                if (!exhaustive) lb[i] = bound_lo(second_min(dist, K, a), c);
            }
        } else {
            /* half the distance from each codeword to its nearest other one (a lower bound; only when cheap
             * against the points) */
            bool use_half = K <= 4 * n;
            for (size_t k = 0; k < K; k++) {
                half[k] = 0;
                if (!use_half) continue;
                kvq_vq_nearest_t(cb + k * c, cbt, K, c, dist);
                half[k] = 0.5 * bound_lo(second_min(dist, K, k), c);
            }
            for (size_t i = 0; i < n; i++) {
                uint32_t a0 = as[i];
                /* the other codewords moved by at most this much since l was set */
                double l = (lb[i] - (a0 == maxmove_at ? maxmove2 : maxmove1)) * (1.0 - 1e-15);
                const float *xi = x + i * c;
                float fa = dist1(xi, cb + (size_t)a0 * c, c);
                double B = l > half[a0] ? l : half[a0];
                if (B > 0 && B * B > bound_hi2(fa, c) && isfinite(fa)) { /* provably still the nearest */
                    lb[i] = l;
                    J += (w ? (double)w[i] : 1.0) * (double)fa;
                    continue;
                }
                uint32_t a = (uint32_t)kvq_vq_nearest_t(xi, cbt, K, c, dist);
                if (a != a0) changed++;
                as[i] = a;
                J += (w ? (double)w[i] : 1.0) * (double)dist[a];
                lb[i] = bound_lo(second_min(dist, K, a), c);
            }
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
        memcpy(old, cb, K * c * sizeof *cb);
        for (size_t k = 0; k < K; k++)
            if (sw[k] > 0)
                for (size_t d = 0; d < c; d++) cb[k * c + d] = (float)(sum[k * c + d] / sw[k]);
        /* the largest and second-largest codeword moves (for the points' lower bounds) */
        maxmove1 = maxmove2 = 0;
        maxmove_at = 0;
        for (size_t k = 0; k < K; k++) {
            mv[k] = move_hi(old + k * c, cb + k * c, c);
            if (mv[k] > maxmove1) {
                maxmove2 = maxmove1;
                maxmove1 = mv[k];
                maxmove_at = k;
            } else if (mv[k] > maxmove2) {
                maxmove2 = mv[k];
            }
        }
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
done:
    free(xt);
    free(dn);
    free(b1);
    free(b2);
    free(old);
    free(p);
    free(lb);
    free(sum);
    free(sw);
    free(mv);
    free(half);
    free(bs);
    free(cbt);
    free(dist);
    free(as);
    return st;
}
