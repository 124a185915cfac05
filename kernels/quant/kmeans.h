/* kmeans.h — weighted 1-D k-means for nuqX datatypes: Lloyd's algorithm
 * (what KVQuant runs: sklearn KMeans, one k-means++ start, max_iter 50,
 * SQ:497-530 in ../shared/docs/kvquant.md §2) and an exact optimum.
 *
 * Problem: given points x[i] with weights w[i] >= 0 (Fisher information,
 * KVQuant App.D/E; w == NULL means 1), find k centres c minimising
 *     J(c) = sum_i w[i] * (x[i] - c[nearest(x[i])])^2 .
 *
 * Both solvers work on "atoms": the points sorted and merged into
 *  - exact mode (n <= n_bins): one atom per distinct x value, or
 *  - histogram mode (n > n_bins): one atom per non-empty bin of a uniform
 *    n_bins-bin histogram over [min x, max x],
 * each atom carrying exact moments (sum w, sum w x, sum w x^2) in double, so
 * the cost of a cluster of atoms is computed exactly; histogram mode only
 * restricts cluster boundaries to bin edges (2/n_bins of the range apart;
 * 3e-5 on [-1, 1] at the default 65536, well below an fp16 ulp near 1).
 *  - Lloyd: weighted k-means++ seeding (greedy, 2 + floor(ln k) local trials
 *    per centre, as sklearn) from a fixed seed (splitmix64; no global state),
 *    then Lloyd iterations on the atoms until the assignment no longer
 *    changes or max_iter (default 100) is reached. An empty cluster keeps its
 *    centre.
 *  - Exact: dynamic programming over the sorted atoms, D[j][i] = min_m
 *    D[j-1][m] + cost(m, i), with the divide-and-conquer optimisation
 *    (valid because the 1-D squared-error cost is Monge; Grønlund et al.
 *    2017, "Fast exact k-means, k-medians and Bregman divergence clustering
 *    in 1D"; Wang & Song 2011, Ckmeans.1d.dp): O(k m log m) time, O(k m)
 *    memory for the back-pointers. Optimal over atom partitions, hence exact
 *    in exact mode.
 * Objectives are reported as J evaluated on the original points with the
 * quantizer's nearest-level rule (kvq_nuq_nearest), so they are comparable
 * and are what the datatype will cost. KVQ_FIT_AUTO runs both and returns the
 * centres with the lower J (exact on ties).
 *
 * Centres come out sorted ascending. When fewer than k atoms exist, every
 * atom becomes a centre and the remaining centres are placed at the
 * midpoints of the widest gaps (all equal if only one value exists); such
 * extra levels never increase J.
 */
#ifndef KVQ_KMEANS_H
#define KVQ_KMEANS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef enum {
    KVQ_FIT_AUTO = 0, /* run both, keep the better */
    KVQ_FIT_LLOYD,
    KVQ_FIT_EXACT
} kvq_fit_method;

const char *kvq_fit_method_name(kvq_fit_method m); /* "auto", "lloyd", "exact" */

typedef struct {
    kvq_fit_method method; /* default AUTO */
    size_t n_bins;         /* 0 → 65536 */
    int max_iter;          /* Lloyd iterations; 0 → 100 */
    uint64_t seed;         /* k-means++ seed (default 0) */
} kvq_kmeans_opts;

typedef struct {
    double obj_lloyd;      /* J of Lloyd's centres; -1 if not run */
    double obj_exact;      /* J of the exact solver's centres; -1 if not run */
    int lloyd_iters;       /* iterations run */
    bool lloyd_converged;  /* assignment reached a fixed point */
    kvq_fit_method chosen; /* LLOYD or EXACT */
    size_t n_points;       /* points with w > 0 */
    size_t n_atoms;        /* distinct values or non-empty bins */
    bool histogram;        /* histogram mode was used */
    double total_weight;
} kvq_kmeans_info;

/* Fit k (1..256) sorted centres to x[0..n) with weights w (NULL = 1).
 * Errors (KVQ_EINVAL / KVQ_ENUMERIC, naming the index): k out of range, n == 0,
 * non-finite x, negative or non-finite w, total weight 0. opts may be NULL. */
kvq_status kvq_kmeans1d(const float *x, const float *w, size_t n, int k, const kvq_kmeans_opts *opts,
                        float *centres, kvq_kmeans_info *info, kvq_err *err);

/* J(c) on the points, nearest level by kvq_nuq_nearest (centres sorted). */
double kvq_kmeans1d_objective(const float *x, const float *w, size_t n, const float *centres, int k);

#endif
