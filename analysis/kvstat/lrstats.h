/* lrstats.h — kvstat's view of low-rank KV heads (a kvcalib artifact of
 * method lowrank, kernels/schemes/lowrank.c; Yu et al., arXiv 2406.07056 §3):
 * per layer, side and group of G KV heads (D = G * head_dim channels), the
 * explained variance EV(r) = Σ_{j<r} e_j / Σ_j e_j of the leading r
 * principal directions, r = 1..D, twice:
 *   calibrated — e_j = the artifact's eigenvalues (the calibration dump);
 *   realised   — e_j = Σ_t <u_j, x_t>² over the analysed dump's tokens
 *                (positions >= the artifact's n_sink in every sample, keys in
 *                the artifact's stage), the energy the cache keeps on
 *                direction j, over Σ_t |x_t|² (the basis is orthonormal, so
 *                EV(D) = 1 up to rounding).
 * A dump other than the calibration one shows how well the subspace
 * transfers; on the calibration dump itself the two agree. */
#ifndef KVQ_LRSTATS_H
#define KVQ_LRSTATS_H

#include <stdint.h>

#include "artifact.h"
#include "kvstats.h"
#include "status.h"

typedef struct {
    int n_stat_layers, layer_first, n_groups, G, D;
    double ev_target;           /* the artifact's own explained-variance target (kvq.lowrank.ev), fraction */
    uint64_t n_vectors;         /* token vectors per (layer, side, group) */
    double *cal_k, *cal_v;      /* [n_stat_layers][n_groups][D] calibrated EV(r = j + 1) */
    double *dump_k, *dump_v;    /* [n_stat_layers][n_groups][D] realised EV(r = j + 1) */
} kvq_lrstats;

/* Requires a lowrank artifact whose shape matches the source. Errors: KVQ_EINVAL (not a lowrank artifact,
 * missing tables), KVQ_ENOMEM, the source's read errors (prefixed with the layer). */
kvq_status kvq_lrstats_compute(const kvq_kvsrc *src, const kvq_artifact *a, bool quiet, kvq_lrstats *out, kvq_err *err);
void kvq_lrstats_free(kvq_lrstats *s);
/* The smallest r (1..D) whose EV reaches ev in curve[D] (D when none does). */
int kvq_lrstats_rank_at(const double *curve, int D, double ev);

#endif
