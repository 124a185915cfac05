/* vq.h — vector quantization in c dimensions: the nearest codeword of a
 * codebook and a weighted c-dimensional k-means (Lloyd) that learns one.
 * The quantizer of coupled quantization (CQ; Zhang et al., arXiv 2405.03917
 * §3.2, "centroid learning"), where c contiguous channels of a token are
 * coded jointly by one b-bit index into 2^b centroids; 1-D k-means for nuq
 * datatypes is kmeans.h.
 *
 * Layout: points x[n][c], codebook cb[K][c] (row-major fp32), weights w[n]
 * (w == NULL means 1).
 *
 * Nearest codeword: the index k minimising the float sum over d = 0..c-1 (in
 * that order) of (x[d] - cb[k][d])^2, ties to the lowest index. Training and
 * the cache quantizer use this one rule, so a codebook's objective is what the
 * cache will cost.
 *
 * k-means: minimise J = sum_i w[i] * ||x[i] - cb[nearest(x[i])]||^2 by
 * weighted k-means++ seeding (D^2 sampling, one candidate per centre, from a
 * fixed splitmix64 seed: no global state, deterministic) and Lloyd iterations
 * (centres = weighted means in double) until at most 0.1% of the
 * assignments change or max_iter. An empty cluster keeps its centre. Points of weight 0 never move
 * a centre. With fewer distinct weighted points than K the extra centres
 * repeat earlier ones (never increasing J).
 *
 * Cost: the assignment after seeding comes from the seeding's own distances;
 * later assignments skip every point whose codeword Hamerly's bounds (a lower
 * bound of the distance to the second-nearest codeword, decreased by the
 * codewords' moves, and half the distance between codewords; Hamerly 2010,
 * "Making k-means even faster") prove unchanged, with margins for float
 * rounding, so the result is exactly that of a full search every iteration
 * (opts.exhaustive): the same codebook, iterations and J, bit for bit,
 * for any thread count (the function is sequential). */
#ifndef KVQ_VQ_H
#define KVQ_VQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

#define KVQ_VQ_MAX_K 4096 /* codewords (b <= 12) */
#define KVQ_VQ_MAX_DIM 64 /* channels per codeword */

/* Nearest codeword of one point x[c] in cbt, the codebook TRANSPOSED: cbt[c][K]
 * (kvq_vq_transpose). dist: scratch of K floats. Returns the index. */
size_t kvq_vq_nearest_t(const float *x, const float *cbt, size_t K, size_t c, float *dist);

/* cbt[d][k] = cb[k][d] for a codebook cb[K][c]. */
void kvq_vq_transpose(float *cbt, const float *cb, size_t K, size_t c);

typedef struct {
    int max_iter;      /* Lloyd iterations after seeding (0 -> 20) */
    uint64_t seed;     /* k-means++ seed */
    const float *init; /* NULL: k-means++; else the initial codebook [K][c] (finite), no seeding */
    bool exhaustive;   /* every assignment by a full search, no bounds (the reference the bounds must equal) */
} kvq_vq_opts;

typedef struct {
    double objective;  /* J after the last assignment (weighted squared error) */
    int iterations;    /* Lloyd iterations run */
    size_t n_used;     /* codewords holding at least one point of weight > 0 */
} kvq_vq_report;

/* Learn cb[K][c] from x[n][c] with weights w (NULL = 1). Requires n >= 1,
 * 1 <= K <= KVQ_VQ_MAX_K, 1 <= c <= KVQ_VQ_MAX_DIM, weights finite >= 0 with a
 * positive sum. Errors: KVQ_EINVAL (sizes, weights; the message names them),
 * KVQ_ENOMEM. rep may be NULL. */
kvq_status kvq_vq_kmeans(const float *x, const float *w, size_t n, size_t c, size_t K, const kvq_vq_opts *o, float *cb,
                         kvq_vq_report *rep, kvq_err *err);

#endif
