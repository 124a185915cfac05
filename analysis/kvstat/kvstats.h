/* kvstats.h — streaming statistics of captured keys and values (kvstat).
 *
 * What it computes, per dumped layer (see kvq_kvstats below):
 *  - per channel, per KV head and per layer, for the pre-RoPE keys
 *    (k_pre_rope), the post-RoPE keys (k) and the values (v): absmax, signed
 *    min/max, mean and std of x, mean and std of |x|, kurtosis of x, and the
 *    99th / 99.9th percentiles of |x|;
 *  - outlier channels: channels whose magnitude statistic (mean |x|, absmax or
 *    p99 |x|, opts.outlier_stat) is >= opts.outlier_mult x the median of that
 *    statistic over the layer's channels, ranked by that ratio (the outlier
 *    key channels of KVQuant §3.1 / KIVI §3 Fig. 2);
 *  - per token: the L2 norm of each token's key/value vector (all KV heads);
 *  - attention: the attention mass each position receives (mean over samples,
 *    per query head), the argmax position per layer and the attention sinks /
 *    pivot tokens (StreamingLLM, KVQuant §3.5, IntactKV §2.1) with token ids;
 *  - pre- vs post-RoPE spread (why KVQuant §3.1 quantizes keys before RoPE).
 *
 * Streaming: the data come from a kvq_kvsrc (a kvdump file or arrays), read
 * in slabs of opts.chunk_tokens positions of one sample of one layer tensor,
 * so memory is O(kv_dim x sketch bins + n_layers x N x L), never the dump.
 *
 * Numerics:
 *  - Moments are kept in double as (n, mean, M2, M3, M4) central sums; each
 *    slab is reduced two-pass and merged with the pairwise formulas of Chan,
 *    Golub & LeVeque (1979) extended to M3/M4 by Pébay (2008, SAND2008-6212,
 *    eq. 2.1-2.3) — not sum/sum² (cf. ../shared/docs/code-style-anchors.md §4.4).
 *  - Percentiles of |x| come from a log-bucketed histogram (the DDSketch of
 *    Masson et al., VLDB 2019): bucket k >= 1 holds (vmin·γ^(k-2), vmin·γ^(k-1)],
 *    γ = (1+α)/(1-α), and reports 2·vmin·γ^(k-1)/(1+γ). The q-quantile is the
 *    nearest-rank one (the value of rank ⌈q·n⌉ in ascending order); the
 *    reported value v' satisfies |v' - v| <= α·v for v in [vmin, vmax], and
 *    |v' - v| < vmin below vmin (bucket 0 reports 0). Results are capped at
 *    the exact absmax. Defaults α = 0.005, vmin = 1e-6, vmax = 1e6.
 *  - Kurtosis is Pearson's β2 = n·M4 / M2² (3 for a Gaussian, 1.8 uniform).
 */
#ifndef KVQ_KVSTATS_H
#define KVQ_KVSTATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* ---- tensors of a dump ----------------------------------------------------- */

typedef enum {
    KVQ_KVT_K_PRE_ROPE = 0,  /* key projection output before RoPE     [L][n_kv_heads][head_dim] */
    KVQ_KVT_K,               /* key after RoPE (what a cache holds)   [L][n_kv_heads][head_dim] */
    KVQ_KVT_V,               /* value projection output               [L][n_kv_heads][head_dim] */
    KVQ_KVT_FISHER_K_PRE_ROPE, /* (dℓ/dk_pre_rope)², float32          [L][n_kv_heads][head_dim] */
    KVQ_KVT_FISHER_V,        /* (dℓ/dv)²                              [L][n_kv_heads][head_dim] */
    KVQ_KVT_ATTN_RECEIVED,   /* attention mass each key position receives, summed over queries [n_heads][L] */
    KVQ_KVT_COUNT
} kvq_kvt;

/* The tensors statistics are computed on: k_pre_rope, k, v. */
#define KVQ_KVT_N_STAT 3

/* Dataset name as in the dump ("k_pre_rope", "k", "v", "fisher_k_pre_rope", "fisher_v", "attn_received"). */
const char *kvq_kvt_name(kvq_kvt t);
/* Human title ("pre-RoPE keys", "post-RoPE keys", "values", ...). */
const char *kvq_kvt_title(kvq_kvt t);

/* ---- source of captured tensors ------------------------------------------------
 * A read-only view of a dump: shape fields plus two callbacks. read_rows reads
 * positions [t0, t0+n) of one sample of one layer tensor as float32:
 *   per-token tensors:  out = [n][n_kv_heads][head_dim]  (channel c = h*head_dim + d)
 *   KVQ_KVT_ATTN_RECEIVED: out = [n_heads][n]
 * Implementations: kvq_kvsrc_mem_init (arrays, tests) and the kvdump file
 * adapter kvq_kvsrc_dump_open (kvsrc_dump.h). */
typedef struct {
    int n_layers;                 /* layers of the model */
    int layer_first, layer_last;  /* inclusive range present in the source */
    int n_heads, n_kv_heads, head_dim;
    int64_t n_samples, seq_len;   /* N, L */
    bool has_fisher, has_attn;
    char model[256];              /* model name for titles (e.g. file basename) */
    char model_sha256[65];        /* "" if unknown */
    void *ctx;
    kvq_status (*read_rows)(void *ctx, int layer, kvq_kvt t, int64_t sample, int64_t t0, int64_t n,
                            float *out, kvq_err *err);
    kvq_status (*read_tokens)(void *ctx, int64_t s0, int64_t n, int32_t *out, kvq_err *err);
} kvq_kvsrc;

/* Arrays behind kvq_kvsrc_mem_init; pointers are borrowed. Layer j of the
 * arrays is model layer layer_first + j. Per-token tensors [N][L][n_kv_heads][head_dim],
 * attn [N][n_heads][L], tokens [N][L]. NULL = absent (k_pre_rope, k, v and
 * tokens are required). */
typedef struct {
    const float *const *t[KVQ_KVT_COUNT]; /* t[tensor][j] -> that layer's array, or t[tensor] == NULL */
    const int32_t *tokens;
    kvq_kvsrc shape;                      /* filled by kvq_kvsrc_mem_init (the callbacks read it) */
} kvq_kvsrc_mem;

/* Complete src, whose shape fields (n_layers, layer_first, layer_last,
 * n_heads, n_kv_heads, head_dim, n_samples, seq_len, model) the caller set,
 * over the arrays in m; m must outlive src (src->ctx = m). has_fisher /
 * has_attn are derived from m. KVQ_EINVAL if a shape field is not positive,
 * the layer range is bad or a required array is missing. */
kvq_status kvq_kvsrc_mem_init(kvq_kvsrc *src, kvq_kvsrc_mem *m, kvq_err *err);

/* Read one head of one sample of a per-token tensor: out = [L][head_dim]
 * (chunked reads; memory L*head_dim floats). KVQ_EINVAL naming layer/head/sample if out of range. */
kvq_status kvq_kvsrc_read_head(const kvq_kvsrc *src, int layer, kvq_kvt t, int64_t sample, int head,
                               float *out, kvq_err *err);

/* ---- building blocks (exposed for tests and for other analyses) ------------ */

/* Central moments of a stream: n, mean, M2 = Σ(x-mean)², M3, M4 (double). */
typedef struct {
    double n, mean, m2, m3, m4;
} kvq_moments;

/* Add one value (Welford / Terriberry update). */
void kvq_moments_push(kvq_moments *m, double x);
/* a := a ∪ b (Chan/Pébay pairwise merge; either may be empty). */
void kvq_moments_merge(kvq_moments *a, const kvq_moments *b);
/* Two-pass moments of x[i*stride], i < n, in double (n = 0 gives all zeros). */
kvq_moments kvq_moments_of(const float *x, size_t n, size_t stride);
/* Population variance M2/n, Pearson kurtosis n·M4/M2² (0 when M2 == 0). */
double kvq_moments_var(const kvq_moments *m);
double kvq_moments_kurtosis(const kvq_moments *m);

/* Log-bucketed magnitude histogram layout (see the header comment). */
typedef struct {
    double alpha;   /* relative accuracy, (0, 0.5) */
    double vmin, vmax;
    double gamma, log_gamma;
    int n_bins;     /* bucket 0 (< vmin) + log buckets up to vmax (larger values land in the last) */
} kvq_sketch;

/* alpha in (0, 0.5), 0 < vmin < vmax; KVQ_EINVAL otherwise. */
kvq_status kvq_sketch_init(kvq_sketch *s, double alpha, double vmin, double vmax, kvq_err *err);
/* Bucket of a magnitude v >= 0 (NaN goes to bucket 0). */
int kvq_sketch_bucket(const kvq_sketch *s, double v);
/* Representative value of bucket k (0 for bucket 0). */
double kvq_sketch_value(const kvq_sketch *s, int k);
/* Nearest-rank q-quantile (q in [0, 1]) of the counts [n_bins], total = Σ counts > 0,
 * capped at cap (pass the exact absmax, or INFINITY). Returns 0 if total == 0. */
double kvq_sketch_quantile(const kvq_sketch *s, const uint64_t *counts, uint64_t total, double q, double cap);

/* ---- results ---------------------------------------------------------------- */

typedef struct {
    uint64_t n;               /* values */
    double absmax;            /* max |x| */
    double min, max;          /* signed range */
    double mean, std;         /* of x (population std) */
    double mean_abs, std_abs; /* of |x| over tokens: the channel "magnitude" and its token-wise spread */
    double kurtosis;          /* Pearson β2 of x */
    double p99, p999;         /* 99th / 99.9th percentile of |x| (sketch, ≤ α relative error) */
} kvq_chan_stats;

typedef enum {
    KVQ_OUTLIER_MEAN_ABS = 0, /* mean |x| over tokens (default: channel-wide, robust to single tokens) */
    KVQ_OUTLIER_ABSMAX,       /* max |x| */
    KVQ_OUTLIER_P99           /* 99th percentile of |x| */
} kvq_outlier_stat;

/* "mean", "absmax", "p99". */
const char *kvq_outlier_stat_name(kvq_outlier_stat s);
/* The selected statistic of one channel. */
double kvq_chan_stat_value(const kvq_chan_stats *c, kvq_outlier_stat s);

/* One tensor (k_pre_rope, k or v) of one layer. */
typedef struct {
    kvq_chan_stats *chan;    /* [kv_dim], channel c = h*head_dim + d */
    kvq_chan_stats *head;    /* [n_kv_heads], pooled over the head's channels */
    kvq_chan_stats all;      /* pooled over the layer */
    double median_stat;      /* median over channels of the outlier statistic */
    int n_outliers;          /* channels with stat >= outlier_mult * median_stat */
    int *outlier_chan;       /* [n_outliers] channel indices, ranked by ratio (descending) */
    double *outlier_ratio;   /* [n_outliers] stat / median_stat */
    float *tok_norm;         /* [N][L] L2 norm of each token's vector over all kv_dim channels */
} kvq_tensor_stats;

/* A position of one sample that acts as an attention sink in a layer. */
typedef struct {
    int64_t sample, pos;
    int32_t token;           /* token id at (sample, pos) */
    double share;            /* attention share: received / (L - pos), mean over query heads:
                                the mean probability the queries that can see pos give it */
    double received;         /* received mass, mean over query heads */
} kvq_sink;

/* A (sample, position) that is a sink in several layers (a pivot token). */
typedef struct {
    int64_t sample, pos;
    int32_t token;
    int n_layers;            /* layers in which it is a sink */
    double max_share;        /* largest share over those layers */
} kvq_pivot;

typedef struct {
    int layer;                            /* model layer index */
    kvq_tensor_stats t[KVQ_KVT_N_STAT];   /* k_pre_rope, k, v */
    /* pre- vs post-RoPE keys (mean |x| per channel = m_c over the layer's kv_dim channels) */
    double spread_var_ratio;              /* var_c(m_c pre) / var_c(m_c post); > 1: RoPE smears channel magnitudes */
    double maxmed_pre, maxmed_post;       /* max_c m_c / median_c m_c */
    double cv_pre, cv_post;               /* mean over channels of std|x| / mean|x| over tokens (token-wise
                                             fluctuation of a channel's magnitude; RoPE rotates pairs, raising it) */
    /* attention (NULL / -1 without attn_received) */
    double *attn_recv;                    /* [n_heads][L] received mass, mean over samples */
    double *attn_share;                   /* [N][L] share (see kvq_sink), mean over query heads */
    int64_t top_pos;                      /* argmax_j of Σ_h attn_recv[h][j] */
    double top_frac;                      /* that position's fraction of all attention mass (Σ = L per head) */
    int n_sinks;
    kvq_sink *sinks;                      /* [n_sinks] ranked by share, at most opts.max_sinks */
} kvq_layer_stats;

typedef struct {
    double outlier_mult;          /* outlier channel: stat >= mult x layer median (default 4) */
    kvq_outlier_stat outlier_stat;/* default KVQ_OUTLIER_MEAN_ABS */
    double sink_share;            /* sink: attention share >= this (default 0.2) ... */
    int64_t sink_min_queries;     /* ... and seen by >= this many queries (L - pos); 0 = max(1, L/8) */
    int max_sinks;                /* per layer (default 16) */
    double sketch_alpha;          /* default 0.005 */
    double sketch_vmin, sketch_vmax; /* default 1e-6, 1e6 */
    int64_t chunk_tokens;         /* positions per read (default 256) */
    bool quiet;                   /* no progress on stderr */
    const char *progress_label;   /* default "kvstat" */
} kvq_kvstats_opts;

kvq_kvstats_opts kvq_kvstats_opts_default(void);

typedef struct {
    /* shape (copied from the source) */
    int n_layers, layer_first, layer_last, n_stat_layers; /* n_stat_layers = layer_last - layer_first + 1 */
    int n_heads, n_kv_heads, head_dim, kv_dim;
    int64_t n_samples, seq_len;
    bool has_attn;
    char model[256];
    kvq_kvstats_opts opts;       /* as used (defaults resolved) */
    kvq_sketch sketch;
    int32_t *tokens;             /* [N][L] */
    kvq_layer_stats *layers;     /* [n_stat_layers]; layers[j].layer = layer_first + j */
    int n_pivots;
    kvq_pivot *pivots;           /* positions that are sinks in >= 1 layer, ranked by n_layers then share */
} kvq_kvstats;

/* Stream the whole source once (layer by layer, tensor by tensor, sample by
 * sample, chunk_tokens positions at a time) and fill *out (free with
 * kvq_kvstats_free). Progress (positions read) on stderr unless opts->quiet.
 * Errors: from the source's read callbacks (prefixed with layer/tensor),
 * KVQ_EINVAL (bad opts, N·L > 2^32-1), KVQ_ENOMEM, KVQ_ENUMERIC (NaN/Inf value,
 * with layer, tensor, sample, position and channel). */
kvq_status kvq_kvstats_compute(const kvq_kvsrc *src, const kvq_kvstats_opts *opts, kvq_kvstats **out,
                               kvq_err *err);
void kvq_kvstats_free(kvq_kvstats *s);

/* Layer stats by model layer index, or NULL if not in the range. */
const kvq_layer_stats *kvq_kvstats_layer(const kvq_kvstats *s, int layer);

/* ---- quantization error (with a calibration artifact) -----------------------
 * A scheme is a quantize→dequantize callback over one layer's keys or values
 * of one sample: in/out [n_tokens][kv_dim] (keys pre- or post-RoPE as the
 * scheme wants: it receives both and picks), n_outliers += elements kept
 * exact as sparse outliers, n_elems += elements considered. */
typedef struct {
    const char *name;                 /* e.g. "nuq4-1%" */
    void *ctx;
    bool keys_post_rope;              /* quantize k instead of k_pre_rope (error measured on the same tensor) */
    kvq_status (*quantize)(void *ctx, int layer, bool is_value, const float *in, size_t n_tokens,
                           size_t kv_dim, float *out, uint64_t *n_outliers, uint64_t *n_elems, kvq_err *err);
    /* calibrated outlier fraction per layer [n_layers of the model] for K and V, or NULL */
    const double *calib_outlier_frac_k, *calib_outlier_frac_v;
} kvq_qscheme;

/* Per scheme, per layer errors. Fisher-weighted error (KVQuant §3.2 objective):
 * Σ F·(x - x̂)² / Σ 1 over the layer's elements (per element mean, same units
 * as MSE times Fisher), F = fisher_k_pre_rope / fisher_v. */
typedef struct {
    int n_schemes, n_stat_layers, layer_first;
    char (*names)[64];         /* [n_schemes] */
    double *mse_k, *mse_v;     /* [n_schemes][n_stat_layers] */
    double *fw_k, *fw_v;       /* [n_schemes][n_stat_layers], NaN without Fisher */
    double *sig_k, *sig_v;     /* [n_stat_layers] mean x² of the tensor (for relative error) */
    double *outl_k, *outl_v;   /* [n_schemes][n_stat_layers] realised outlier fraction */
    double *calib_k, *calib_v; /* [n_schemes][n_stat_layers] calibrated fraction, NaN if unknown */
} kvq_qerr;

/* Run every scheme over every sample of every layer (chunk = one sample;
 * memory: a few [L][kv_dim] buffers). Errors from the source or a scheme. */
kvq_status kvq_qerr_compute(const kvq_kvsrc *src, const kvq_qscheme *schemes, int n_schemes, bool quiet,
                            kvq_qerr *out, kvq_err *err);
void kvq_qerr_free(kvq_qerr *q);

/* Histogram of normalised values x_n = (x - zp) / r over one layer tensor
 * (all samples and positions), as nuqX sees them (KVQuant §3.3):
 *  - keys (lower/upper [kv_dim] given): per-channel zp = (U+L)/2, r = (U-L)/2
 *    from the calibrated thresholds;
 *  - values (lower = upper = NULL): per token over kv_dim channels, [lo, hi] =
 *    the (k+1)-th smallest / largest value with k = kvq_outliers_per_side(kv_dim,
 *    v_outlier_frac) (kvq_token_range, kernels/quant/quant.h).
 * counts [n_bins] over [lo_x, hi_x] are incremented (+=); values outside go
 * to *under / *over. Channels/tokens with r == 0 are skipped. */
kvq_status kvq_normhist_layer(const kvq_kvsrc *src, int layer, kvq_kvt t, const float *lower,
                              const float *upper, double v_outlier_frac, double lo_x, double hi_x, int n_bins,
                              uint64_t *counts, uint64_t *under, uint64_t *over, kvq_err *err);

#endif
