/* cqstats.h — kvstat's view of coupled-quantization codebooks (a kvcalib
 * artifact of method cq, kernels/schemes/cq.c; Zhang et al., arXiv
 * 2405.03917 §3.2): over the dump's tokens (positions >= the artifact's
 * n_sink in every sample, keys in the artifact's stage), per layer, side and
 * group of c channels, how often each of the 2^b codewords is the nearest
 * (kvq_vq_nearest_t, the cache's own rule) and the group's squared error.
 * Summaries per (layer, side): codewords in use, the entropy of the index
 * distribution (bits; b would be a uniformly used codebook), the mean and the
 * worst per-group MSE per element. */
#ifndef KVQ_CQSTATS_H
#define KVQ_CQSTATS_H

#include <stdint.h>

#include "artifact.h"
#include "kvstats.h"
#include "status.h"

typedef struct {
    int n_stat_layers, layer_first, n_groups, c, bits;
    uint64_t n_vectors;          /* vectors coded per (layer, side, group) */
    uint64_t *count_k, *count_v; /* [n_stat_layers][n_groups][1 << bits] index counts */
    double *sse_k, *sse_v;       /* [n_stat_layers][n_groups] sum of squared errors */
} kvq_cqstats;

typedef struct {
    double used;         /* codewords with a count > 0, mean over the groups */
    double entropy_bits; /* index entropy, mean over the groups */
    double mse_mean;     /* per element, mean over the groups */
    double mse_worst;    /* per element, the worst group */
    int worst_group;     /* its index (channels worst_group*c .. +c-1) */
} kvq_cq_summary;

/* Requires a cq artifact whose shape matches the source (kvq_artifact_check_source). Errors: KVQ_EINVAL (not a
 * cq artifact), KVQ_ENOMEM, the source's read errors (prefixed with the layer). */
kvq_status kvq_cqstats_compute(const kvq_kvsrc *src, const kvq_artifact *a, bool quiet, kvq_cqstats *out, kvq_err *err);
void kvq_cqstats_free(kvq_cqstats *c);
/* Summary of stat layer j (0-based), side 'k' or 'v'. */
void kvq_cqstats_summary(const kvq_cqstats *c, int j, char side, kvq_cq_summary *s);

#endif
