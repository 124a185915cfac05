/* xlayer.h — kvstat's cross-layer view (MiniCache, Liu et al., arXiv 2405.14366: §3's observation that
 * adjacent layers' KV states are similar from the middle of the model on, §4.1's retention rule;
 * kernels/schemes/minicache.c): for every adjacent pair of dumped layers (l, l+1) and side (post-RoPE
 * keys, values), over every (token, KV head) of the dump (positions >= n_sink in every sample):
 *   - the mean cosine similarity and mean angular distance d = arccos(cos) / pi of the two head vectors;
 *   - the retained fraction: the share of (token, KV head) with d above the retention threshold, per KV
 *     head d_max - (d_max - d_min) gamma over the dump (the paper's rule, as kvcalib --method minicache
 *     computes it), or the thresholds of a minicache artifact (its layers.<l>.<k|v>.theta) and which
 *     pairs it merges. Zero-norm vectors count as distance 1 (never merged). */
#ifndef KVQ_XLAYER_H
#define KVQ_XLAYER_H

#include <stdbool.h>
#include <stdint.h>

#include "artifact.h"
#include "kvstats.h"
#include "status.h"

typedef struct {
    int n_pairs, layer_first;  /* pair j: layers layer_first + j and layer_first + j + 1 */
    double gamma;              /* the retention rule's gamma (without an artifact's thresholds) */
    bool artifact;             /* thresholds and merged pairs from a minicache artifact */
    uint64_t n_vectors;        /* (token, KV head) vectors per pair and side */
    double *cos_k, *cos_v;     /* [n_pairs] mean cosine similarity */
    double *dist_k, *dist_v;   /* [n_pairs] mean angular distance, [0, 1] */
    double *ret_k, *ret_v;     /* [n_pairs] retained fraction, [0, 1] */
    signed char *merged;       /* [n_pairs] 1: the artifact merges the pair, 0: it does not, -1: no artifact */
} kvq_xlayer;

/* a: NULL, or a minicache artifact whose shape matches the source (its thresholds, pairs and n_sink;
 * gamma and n_sink are then ignored). Needs at least two dumped layers (else KVQ_EINVAL). Errors: the
 * source's reads (prefixed with the layer), KVQ_ENOMEM. */
kvq_status kvq_xlayer_compute(const kvq_kvsrc *src, const kvq_artifact *a, double gamma, int64_t n_sink, bool quiet,
                              kvq_xlayer *out, kvq_err *err);
void kvq_xlayer_free(kvq_xlayer *x);

#endif
