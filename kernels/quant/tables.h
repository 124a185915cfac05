/* tables.h — per-(layer, K|V) calibration tables from arrays (the
 * model-independent core of kvcalib; the HDF5 dump reader feeds it).
 *
 * Inputs, one layer at a time:
 *   keys   k[n_tokens][kv_dim] float32, pre-RoPE by default (KVQuant §3.1;
 *          post-RoPE for the ablation — the caller passes whichever),
 *   values v[n_tokens][kv_dim] float32,
 *   fisher f[n_tokens][kv_dim] float32 >= 0 (optional, NULL → unweighted):
 *          squared gradients of the LM loss w.r.t. that K/V element
 *          (KVQuant App.D, one weight per element, not summed),
 * with n_tokens = n_samples * sample_len rows, samples concatenated. The
 * first n_sink tokens of every sample are excluded from the thresholds and
 * from the fit (they stay full precision at run time, §3.5; the paper's rule,
 * stricter than the repo, which still feeds them to its percentiles).
 *
 * Keys (KVQuant §3.1, §3.4, SQ:400-530):
 *   thresholds: per channel, numpy-linear percentiles over the calibration
 *     tokens at 1 - t and t, t = 1 - outlier_frac / 2 (1% → 0.5th / 99.5th;
 *     0% → min / max), float32 (kvq_percentile_pair_f32, exact selection);
 *   normalise: x_n = (x - zp) / r, zp = (U + L) / 2, r = (U - L) / 2, for
 *     inliers L <= x <= U (x outside is an outlier and is not fitted);
 *   fit: 2^bits levels by weighted 1-D k-means on all channels' x_n (per
 *     layer) or on each head's channels (per head).
 * Values (§3.2): per-token online range (kvq_token_range with
 *   kvq_outliers_per_side(kv_dim, f) per side, exactly what
 *   kvq_quant_nuq_values does at run time), inliers normalised the same way.
 * Points with zero range (constant channel or token) are left out of the
 * fit: the quantizer reproduces them exactly whatever the levels. A table
 * with no points gets uniformly spaced levels on [-1, 1] and objectives -1.
 * NaN/Inf inputs, negative or non-finite Fisher values, bad options: error
 * naming the token/channel or option (the caller prefixes the layer).
 */
#ifndef KVQ_TABLES_H
#define KVQ_TABLES_H

#include <stdbool.h>
#include <stddef.h>

#include "artifact.h"
#include "kmeans.h"
#include "status.h"

typedef struct {
    int bits;               /* 1..8 */
    double outlier_frac;    /* [0, 0.5) */
    size_t n_sink;          /* tokens excluded at the start of every sample */
    size_t sample_len;      /* tokens per calibration sample; 0 = all rows are one sample */
    size_t n_kv_heads;      /* kv_dim = n_kv_heads * head_dim */
    size_t head_dim;
    bool per_head;          /* one datatype per KV head instead of per layer */
    kvq_kmeans_opts fit;    /* method (auto = better of Lloyd / exact), bins, iterations, seed */
} kvq_calib_opts;

/* Check options; errors name the field ("bits: expected 1..8, found 0"). */
kvq_status kvq_calib_opts_validate(const kvq_calib_opts *o, kvq_err *err);

/* Per-channel key thresholds only (intX per-channel keys, and the first
 * half of kvq_calib_keys). lower/upper: [kv_dim] float32. n_out (optional):
 * calibration elements strictly outside [lower, upper]; n_elems: considered. */
kvq_status kvq_calib_key_thresholds(const float *k, size_t n_tokens, const kvq_calib_opts *o, float *lower,
                                    float *upper, uint64_t *n_out, uint64_t *n_elems, kvq_err *err);

/* nuqX keys: thresholds + levels. `out` is filled with owned arrays (free
 * with kvq_kv_table_free); on error it is left empty. */
kvq_status kvq_calib_keys(const float *k, const float *fisher, size_t n_tokens, const kvq_calib_opts *o,
                          kvq_kv_table *out, kvq_err *err);

/* nuqX values: levels (no thresholds; those are online per token). */
kvq_status kvq_calib_values(const float *v, const float *fisher, size_t n_tokens, const kvq_calib_opts *o,
                            kvq_kv_table *out, kvq_err *err);

/* intX per-channel keys: thresholds only (out->n_tables == 0). */
kvq_status kvq_calib_int_pc_keys(const float *k, size_t n_tokens, const kvq_calib_opts *o, kvq_kv_table *out,
                                 kvq_err *err);

/* (kvq_calib_fill_bits, the bits accounting of an artifact's parameters: artifact.h) */

#endif
