/* quant.h — quantize→dequantize reference primitives for KV-cache schemes
 * (CPU, the semantics kveval simulates and the runtime kernels must match).
 *
 * Layout (every function): one layer's keys or values for one sequence or
 * window, `x[n_tokens][kv_dim]` row-major float32, kv_dim = n_kv_heads *
 * head_dim, channel c = h * head_dim + d (head-major, the k_proj / v_proj
 * output order). Keys may be pre- or post-RoPE; the primitives do not care,
 * the scheme decides which tensor it passes. `out` may equal `in` (in place);
 * otherwise they must not overlap.
 *
 * Numerics (shared by every scheme below):
 *  - Scales, zero points and normalisation are computed in double from the
 *    float32 inputs; results are rounded once to float32. Rounding to an
 *    integer code is round-half-to-even (rint in the default FP environment,
 *    the same as torch.round). No FMA contraction (-std=c17 implies
 *    -ffp-contract=off).
 *  - A zero range (constant group / channel / token) gives scale 0: the code
 *    is 0 and the reconstruction is the zero point, so constant data round-
 *    trips exactly and no NaN/Inf is produced. Finite input never yields a
 *    non-finite output. Inputs must be finite (dumps are validated upstream).
 *  - Scales and zero points are kept in float32/double here; the bits
 *    accounting (kvq_scheme_bits) charges them as fp16, as the papers do.
 *
 * Sources: KVQuant (Hooper et al., arXiv 2401.18079): §3.1-3.2 per-channel
 * pre-RoPE keys / per-token values, §3.3 nuqX datatypes, §3.4 per-vector
 * dense-and-sparse outliers, §3.5 attention sink, App.M bits accounting,
 * App.G/App.P uniform baselines; repo notes in ../shared/docs/kvquant.md.
 * KIVI (Liu et al., arXiv 2402.02750) §3-4 and ../shared/docs/kivi-intactkv-mikv.md §1.
 */
#ifndef KVQ_QUANT_H
#define KVQ_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

#define KVQ_QUANT_MAX_BITS 8

/* Counters, accumulated (+=) so a caller can sum over layers/windows. The
 * realised outlier fraction of a run is n_outliers / n_elems. */
typedef struct {
    uint64_t n_elems;    /* elements passed through a quantizer call */
    uint64_t n_outliers; /* kept exact as sparse outliers (dense-and-sparse) */
    uint64_t n_sink;     /* kept exact because the token is an attention-sink token */
    uint64_t n_exact;    /* kept exact for other reasons (KIVI incomplete group / residual, a recent window) */
    uint64_t n_high;     /* kept at a mixed-precision scheme's high precision (heavy hitters) */
    uint64_t n_code_bits;/* sum of the code bits of the elements a per-token variable-width scheme quantized (QAQ:
                          * each (token, head) at its own width); 0 for fixed-width schemes */
    uint64_t n_clipped;  /* beyond the storage format's range and saturated to its largest finite value:
                          * fp16 |x| >= 65520 (a real fp16 cache would hold Inf), fp8 |x / s| at or past
                          * the saturation midpoint (kvq_fp8_saturation_edge) */
    uint64_t n_coef;     /* numbers a reduced representation stores in place of the non-sink elements it covers
                          * (low-rank KV heads: the projected coefficients, kernels/schemes/lowrank.c); 0 for
                          * the families that store one number per element */
} kvq_quant_counts;

/* The smallest |x| fp16 round-to-nearest-even takes to Inf (65504 + half its last step). */
#define KVQ_FP16_OVERFLOW 65520.0f

/* ---- fp16 ----------------------------------------------------------------
 * out[i] = (float)(half)in[i]: IEEE binary16, round-to-nearest-even, values
 * beyond the half range become ±65504 (saturated, never Inf: an fp16 KV cache
 * that overflowed would be a model bug, not a quantization effect to
 * simulate), subnormals kept. This is what an fp16 KV cache holds. The
 * saturated values (|x| >= KVQ_FP16_OVERFLOW) are counted in n_clipped, so a
 * report can say that a real fp16 cache would have overflowed. */
void kvq_quant_fp16(float *out, const float *in, size_t n, kvq_quant_counts *counts);
/* One value, same rule. */
float kvq_round_fp16(float x);

/* ---- uniform asymmetric intX ---------------------------------------------
 * Per group of values g: mn = min g, mx = max g, s = (mx - mn) / (2^b - 1),
 * q = clamp(rint((x - mn) / s), 0, 2^b - 1), x̂ = q * s + mn; s == 0 → x̂ = mn.
 * Float (unrounded) zero point = the minimum, as KVQuant's quant_fn_zp
 * (App.G: all-positive/all-negative channels) and KIVI (§3, new_pack.py).
 */

/* Per-token, groups of `group` consecutive channels within each token.
 * group == 0 means the whole token (all kv_dim channels, all heads): the
 * KVQuant int baseline (simquant per-token vector = the full k/v_proj output
 * row, App.P). group == head_dim is IntactKV's per-head quantizer (but with a
 * float zero point); group == G is KIVI's value grouping. group must divide
 * kv_dim. The first n_sink tokens are copied exactly (sink, §3.5). */
kvq_status kvq_quant_int_token(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                               size_t group, int bits, size_t n_sink,
                               kvq_quant_counts *counts, kvq_err *err);

/* Per-channel with static (offline, calibrated) thresholds lower[c] <= upper[c]
 * ([kv_dim] float32): mn = lower[c], s = (upper[c] - lower[c]) / (2^b - 1).
 * With `outliers`, values strictly outside [lower, upper] are kept exact
 * (KVQuant §3.4, strict test as its simulation for keys); otherwise they
 * clamp to the extreme codes. First n_sink tokens exact. This is the
 * "intX with per-channel keys" baseline (KVQuant App.G); offline thresholds
 * keep it causal (no token sees statistics of later tokens). */
kvq_status kvq_quant_int_channel(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                                 const float *lower, const float *upper, int bits, bool outliers,
                                 size_t n_sink, kvq_quant_counts *counts, kvq_err *err);

/* ---- nuqX (KVQuant §3.3) ---------------------------------------------------
 * A datatype is a sorted table of 2^bits levels in [-1, 1] ("LUT"), shared by
 * all channels (keys) or tokens (values) of a layer — per-layer (n_tables ==
 * 1), or one per KV head (n_tables == n_kv_heads, channel c uses table
 * c / head_dim; normalisation granularity is unchanged).
 * Normalise: zp = (U + L) / 2, r = (U - L) / 2, x_n = (x - zp) / r (double,
 * rounded to float and clamped to [levels[0], levels[last]], which does not
 * change the nearest level); code = index of the nearest level by float
 * |x_n - level|, ties to the lowest index (the kernels' strict-< argmin);
 * dequantize x̂ = level * r + zp (double, rounded to float). r == 0 → x̂ = zp.
 */
typedef struct {
    int bits;              /* 1..8; n_levels = 1 << bits */
    size_t n_tables;       /* 1 (per-layer) or n_kv_heads (per-head) */
    size_t head_dim;       /* channels per head; used when n_tables > 1 */
    const float *levels;   /* [n_tables][1 << bits], each row ascending (ties allowed) */
} kvq_nuq_lut;

/* Index of the level nearest to x (ties → lowest index); levels ascending, n >= 1. */
size_t kvq_nuq_nearest(const float *levels, size_t n_levels, float x);

/* Keys: per-channel static thresholds lower/upper [kv_dim] (offline, from
 * kvcalib, KVQuant §3.1 + §3.4). With `outliers`, x > upper[c] or x < lower[c]
 * is kept exact (dense-and-sparse); otherwise it maps to the extreme level.
 * First n_sink tokens exact. */
kvq_status kvq_quant_nuq_keys(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                              const kvq_nuq_lut *lut, const float *lower, const float *upper,
                              bool outliers, size_t n_sink, kvq_quant_counts *counts, kvq_err *err);

/* Values: per-token online thresholds over the whole token (all kv_dim
 * channels, KVQuant §3.2; no per-head split, as the repo does). With
 * outlier_frac f > 0, k = kvq_outliers_per_side(kv_dim, f) values per side are
 * outliers: lo / hi = the (k+1)-th smallest / largest value of the token, the
 * dense range is [lo, hi], values x < lo or x > hi are kept exact (ties with
 * lo/hi stay dense, so a token may have fewer than 2k outliers). f == 0:
 * lo / hi = min / max, no outliers. First n_sink tokens exact. */
kvq_status kvq_quant_nuq_values(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                                const kvq_nuq_lut *lut, double outlier_frac, size_t n_sink,
                                kvq_quant_counts *counts, kvq_err *err);

/* Outliers per side for a vector of n values at total fraction f (both tails):
 * 0 if f <= 0, else n - ceil((1 - f/2) (n - 1)) — the count numpy's
 * interpolated percentile at t = 1 - f/2 with KVQuant's `>=` value mask flags
 * (SQ:95-106; e.g. 21 for n = 4096, f = 1%; 1 for n = 192), capped at (n-1)/2. */
size_t kvq_outliers_per_side(size_t n, double f);

/* Per-token dense range (the rule of kvq_quant_nuq_values): writes lo/hi for
 * row[0..n). scratch: [n] floats. */
void kvq_token_range(const float *row, size_t n, size_t k_per_side, float *scratch,
                     float *lo, float *hi);

/* ---- KIVI (arXiv 2402.02750 §3.2-3.3) --------------------------------------
 * Keys per-channel in groups of G consecutive tokens, values per-token in
 * groups of G consecutive channels, both uniform asymmetric (rule above,
 * float min as zero point), 2 or 4 bit in the paper (any 1..8 accepted).
 * Groups are aligned to token n_sink of the given range (token 0 when
 * n_sink == 0, KIVI's alignment to absolute cache index 0); tokens before
 * n_sink are exact (IntactKV / sink prefix, trap 7 of the notes).
 *
 * These are pure functions of the rows given: kveval passes a window and
 * builds decode-equivalent views with kvq_kivi_key_boundary /
 * kvq_kivi_value_boundary: query t sees key j as kvq_kivi_keys' output when
 * j < key_boundary(t), else exact; value j as kvq_kivi_values' output when
 * j < value_boundary(t), else exact. A quantized group depends only on its
 * own tokens, all < boundary <= t, so nothing looks at the future. */

/* Keys: complete G-token groups after n_sink are quantized per channel;
 * the trailing incomplete group (< G tokens) is copied exactly (n_exact). */
kvq_status kvq_kivi_keys(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                         size_t group, int bits, size_t n_sink,
                         kvq_quant_counts *counts, kvq_err *err);

/* Values: every token >= n_sink quantized in groups of G channels; G must
 * divide head_dim (groups never cross heads) and head_dim divide kv_dim. */
kvq_status kvq_kivi_values(float *out, const float *in, size_t n_tokens, size_t kv_dim,
                           size_t head_dim, size_t group, int bits, size_t n_sink,
                           kvq_quant_counts *counts, kvq_err *err);

/* Decode semantics (notes §1.4-1.5, KIVI llama_kivi.py): keys are flushed
 * from the fp16 buffer in chunks of F = R tokens (F = G when R == 0) after the
 * step that fills it has attended, so query t (0-based, t >= n_sink) sees keys
 * [n_sink, n_sink + F*floor((t - n_sink)/F)) quantized; returns that bound.
 * For t < n_sink it returns t + 1: query t attends only keys 0..t, all sink
 * tokens, which kvq_kivi_keys copies exactly, so the choice changes no value;
 * t + 1 keeps the bound a valid attention boundary (b <= t + 1, attention.h).
 * Always n_sink <= result <= t + 1 for t >= n_sink. Requires R % G == 0. */
size_t kvq_kivi_key_boundary(size_t t, size_t group, size_t residual, size_t n_sink);
/* Values: a sliding window; after appending token t the buffer holds R + 1
 * fp16 values while attending, so values [n_sink, max(n_sink, t - R)) are
 * quantized for query t; returns that bound (t + 1 for t < n_sink, as for
 * keys: never above t + 1). */
size_t kvq_kivi_value_boundary(size_t t, size_t residual, size_t n_sink);

/* Schemes (a family and its parameters), their validation and bits
 * accounting: kernels/schemes/family.h. */

#endif
