/* kvcache.h — a packed low-bit KV cache for one layer, fed by the calibration
 * artifact, with decode attention (CPU reference; kvcache_cuda.h is the GPU
 * version of the same layout and semantics).
 *
 * Formats (kvq_kvcache_format):
 *  - NUQ (KVQuant, Hooper et al. arXiv 2401.18079 §3.1-3.5, §3.7; repo notes
 *    ../shared/docs/kvquant.md §3-§8): keys quantized pre-RoPE per channel with
 *    the artifact's offline [lower, upper] thresholds and nuqX levels, values
 *    per token (all kv_dim channels) with online thresholds, both with
 *    dense-and-sparse outliers kept in a compact sparse form; RoPE is applied
 *    after dequantization inside the attention.
 *  - KIVI (Liu et al. arXiv 2402.02750 §3; ../shared/docs/kivi-intactkv-mikv.md
 *    §1): uniform asymmetric keys per channel in groups of G tokens, values per
 *    token in groups of G channels, fp16 residual window of R tokens.
 * In both, the first n_exact = max(n_sink, prefix_len) positions of every
 * sequence (attention sink, KVQuant §3.5; IntactKV prefix, notes §2) are held
 * in fp16 with post-RoPE keys. The exact bit layout: formats/KVCACHE.md.
 *
 * Semantics (what the tests prove, tests/test_kvcache.c): after appending
 * tokens 0..t of a sequence, kvq_kvcache_attend's output for that sequence
 * equals attention (scaled dot product, softmax, weighted sum, fp32/float64)
 * of the query over the keys/values that kernels/quant/quant.h simulates for the
 * same tokens (kvq_quant_nuq_keys / kvq_quant_nuq_values with n_sink =
 * n_exact; KIVI: kvq_kivi_keys / kvq_kivi_values with the decode boundaries
 * kvq_kivi_key_boundary / kvq_kivi_value_boundary for query t), with RoPE
 * (kvq_rope_rotate) applied to pre-RoPE keys after quantization, and with
 * every value the cache holds at 16 bits (exact-region rows, sparse outliers,
 * KIVI residual) rounded to fp16 (kvq_round_fp16). For inputs that are
 * fp16-representable (an fp16 model's K/V) that rounding changes nothing.
 *
 * Concurrency: a cache is not thread-safe; the caller serialises calls.
 */
#ifndef KVQ_KVCACHE_H
#define KVQ_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "artifact.h"
#include "status.h"

#define KVQ_KVCACHE_MAX_HEAD_DIM 256

typedef enum {
    KVQ_KVCACHE_NUQ = 0,  /* KVQuant nuqX keys (per-channel, offline) / values (per-token, online) */
    KVQ_KVCACHE_KIVI      /* KIVI uniform, group G, fp16 residual R */
} kvq_kvcache_format;

/* RoPE as the model applies it (formats/model.h): pairs of adjacent channels
 * (2i, 2i+1), i < rope_dim/2, within each head ("interleaved"), angle
 * pos * inv_freq[i]. inv_freq[i] = rope_theta^(-2i/rope_dim) / scale (linear
 * scaling: positions divided by `scale`), evaluated in double. Channels
 * >= rope_dim are not rotated. rope_dim == 0: no RoPE. */
typedef struct {
    size_t rope_dim;     /* even, <= head_dim */
    double rope_theta;   /* > 0 when rope_dim > 0 */
    double scale;        /* linear position scaling factor; 0 or 1 = none */
} kvq_rope;

/* Rotate `n_rows` rows x[n_rows][n_heads][head_dim] in place as the model's
 * RoPE at positions pos0, pos0 + 1, ...: (a, b) -> (a cos - b sin, a sin + b cos),
 * computed in double, rounded once to float. */
kvq_status kvq_rope_rotate(float *x, size_t n_rows, size_t n_heads, size_t head_dim,
                           const kvq_rope *rope, size_t pos0, kvq_err *err);

typedef struct {
    kvq_kvcache_format format;
    size_t n_seqs;        /* sequences (batch B); each has its own tokens */
    size_t n_kv_heads;    /* KV heads (GQA: query heads are a multiple) */
    size_t head_dim;      /* 1..KVQ_KVCACHE_MAX_HEAD_DIM */
    size_t max_tokens;    /* capacity in positions per sequence (exact region included) */
    int k_bits, v_bits;   /* 2, 3 or 4 */
    size_t n_sink;        /* first positions kept in fp16 (attention sink) */
    size_t prefix_len;    /* IntactKV prefix positions (set with kvq_kvcache_set_prefix), 0 = none */
    bool post_rope;       /* keys quantized after RoPE (no RoPE at decode); NUQ default false */
    kvq_rope rope;
    /* NUQ only (borrowed; copied by kvq_kvcache_create): */
    double outlier_frac;  /* [0, 0.5): > 0 enables dense-and-sparse outliers (keys and values) */
    size_t k_tables, v_tables;      /* 1 (per-layer) or n_kv_heads (per-head) */
    const float *k_levels;          /* [k_tables][1 << k_bits] ascending in [-1, 1] */
    const float *v_levels;          /* [v_tables][1 << v_bits]; fp16 numbers for an exact GPU P·V (kvcache_cuda.h;
                                       artifacts' are: the loader rounds nuq's) */
    const float *k_lower, *k_upper; /* [kv_dim] per-channel thresholds, raw key units */
    /* sparse-outlier storage (NUQ): entries per (sequence, KV head) for keys and for values.
     * outlier_cap: initial capacity (0 = auto: 2 * ceil(outlier_frac * head_dim) + 2 per token
     * of max_tokens); outlier_max: hard limit (0 = none). The store grows (doubling, up to
     * outlier_max); an append that would exceed outlier_max fails with KVQ_ENOMEM, naming
     * the sequence, position and counts; nothing of the failing token is stored. */
    size_t outlier_cap, outlier_max;
    /* KIVI only: */
    size_t group;         /* G: key token-group and value channel-group; divides head_dim */
    size_t residual;      /* R: multiple of G (0 allowed: keys flush every G tokens, values at once) */
} kvq_kvcache_config;

/* Fill cfg from an artifact for one layer: format, bits, n_sink, outlier
 * fraction, key position, group/residual, and borrowed pointers into the
 * artifact's tables (the artifact must outlive kvq_kvcache_create). The
 * caller sets n_seqs, max_tokens, rope and prefix_len. nuq and kivi methods
 * only (int / int-pc → KVQ_EUNSUPPORTED). */
kvq_status kvq_kvcache_config_from_artifact(kvq_kvcache_config *cfg, const kvq_artifact *a,
                                            size_t layer, kvq_err *err);

/* Check a configuration; errors name the field ("head_dim: expected 1..256, found 300"). */
kvq_status kvq_kvcache_config_validate(const kvq_kvcache_config *cfg, kvq_err *err);

/* ---- packed codes (formats/KVCACHE.md "Code words") -----------------------
 * A "unit" holds the codes of consecutive channels of one (token, head):
 * 2-bit: 16 channels in 1 word, 4-bit: 8 channels in 1 word, 3-bit: 32
 * channels in 3 words (one 96-bit little-endian bit stream, channel j at bits
 * [3j, 3j+3), so channels 10 and 21 straddle words). Channel j of a unit sits
 * at bits [b*j, b*j+b) counting from bit 0 of the unit's first word (LSB
 * first). Padding channels (beyond head_dim) hold code 0. */
size_t kvq_kvcache_unit_channels(int bits);   /* 16, 32, 8 for 2, 3, 4 bits; 0 otherwise */
size_t kvq_kvcache_unit_words(int bits);      /* 1, 3, 1 */
size_t kvq_kvcache_head_words(int bits, size_t head_dim); /* words per (token, head) */
/* Pack codes[n] (each < 2^bits) into words[kvq_kvcache_head_words(bits, n)]; unpack inverts. */
void kvq_kvcache_pack(uint32_t *words, const uint8_t *codes, size_t n, int bits);
void kvq_kvcache_unpack(uint8_t *codes, const uint32_t *words, size_t n, int bits);

/* ---- the cache ------------------------------------------------------------ */
typedef struct kvq_kvcache kvq_kvcache;

/* Allocate an empty cache (all sequences at length 0). */
kvq_status kvq_kvcache_create(kvq_kvcache **out, const kvq_kvcache_config *cfg, kvq_err *err);
void kvq_kvcache_free(kvq_kvcache *c);
const kvq_kvcache_config *kvq_kvcache_config_of(const kvq_kvcache *c);

/* Current length (positions) of sequence seq. */
size_t kvq_kvcache_len(const kvq_kvcache *c, size_t seq);

/* Set the IntactKV prefix of an empty sequence: k_post (post-RoPE keys at
 * positions 0..prefix_len-1) and v, each [prefix_len][kv_dim] float32,
 * stored in fp16. Errors: sequence not empty, prefix_len == 0 in cfg. */
kvq_status kvq_kvcache_set_prefix(kvq_kvcache *c, size_t seq, const float *k_post, const float *v,
                                  kvq_err *err);

/* Append n tokens to sequence seq at positions len .. len+n-1.
 * k: pre-RoPE keys [n][kv_dim] (the k_proj output; the cache applies RoPE
 * itself where it must), v: [n][kv_dim], float32, finite. When prefix_len > 0
 * the prefix must be set first. Quantizes with the tables (NUQ value
 * thresholds and outliers per token online; KIVI flushes by the decode
 * boundaries of the last appended position). On an error, the tokens before
 * the failing one stay appended (kvq_kvcache_len says how many). Errors: capacity exceeded
 * (KVQ_ENOMEM naming seq/len/n/max_tokens), outlier store limit, non-finite input. */
kvq_status kvq_kvcache_append(kvq_kvcache *c, size_t seq, const float *k, const float *v, size_t n,
                              kvq_err *err);

/* Decode attention for every sequence: q [n_seqs][n_heads][head_dim] float32,
 * post-RoPE queries of the last appended position; n_heads a multiple of
 * n_kv_heads (query head j uses KV head j / (n_heads / n_kv_heads)).
 * out [n_seqs][n_heads][head_dim] float32 = softmax(scale * q·K̂ᵀ) V̂ over all
 * len(seq) positions (sequences of length 0 give 0). scale <= 0 means
 * 1/sqrt(head_dim). Scores, softmax and the weighted sum in double. */
kvq_status kvq_kvcache_attend(const kvq_kvcache *c, const float *q, size_t n_heads, float scale,
                              float *out, kvq_err *err);

/* Reconstruct what the cache holds for sequence seq, positions [0, len):
 * k_out post-RoPE keys and v_out values, each [len][kv_dim] float32 (the
 * dequantized dense part with outliers / fp16 rows substituted). Used by the
 * tests and by kvq_kvcache_attend. */
kvq_status kvq_kvcache_dequant(const kvq_kvcache *c, size_t seq, float *k_out, float *v_out,
                               kvq_err *err);

/* Storage statistics of the cache in its current state. */
typedef struct {
    size_t n_tokens;       /* positions held (all sequences) */
    size_t n_quant_k, n_quant_v; /* positions whose keys / values are quantized */
    size_t k_outliers, v_outliers; /* sparse entries */
    size_t outlier_capacity;       /* entries allocated per (sequence, KV head) (K and V each) */
    size_t bytes_k, bytes_v;       /* bytes an attention pass reads for K / V (codes, scales,
                                      sparse rows and entries, fp16 rows); tables excluded */
} kvq_kvcache_stats;
void kvq_kvcache_stats_get(const kvq_kvcache *c, kvq_kvcache_stats *s);

/* ---- raw view (for kvcache_cuda and tests; formats/KVCACHE.md) ------------
 * Every pointer is host memory owned by the cache; layout exactly as the GPU
 * copy. Q = quantized positions, capq = capacity in quantized positions
 * (multiple of 32), H = n_kv_heads, D = head_dim, C = H*D = kv_dim. */
typedef struct {
    size_t n_exact;         /* max(n_sink, prefix_len) */
    size_t capq;            /* quantized-position capacity per sequence (multiple of 32) */
    size_t k_head_words, v_head_words; /* words per (token, head) */
    size_t ring;            /* KIVI residual ring slots (0 for NUQ) */
    const size_t *len;      /* [n_seqs] positions */
    const size_t *kq, *vq;  /* [n_seqs] quantized key / value positions (q = pos - n_exact) */
    const bool *prefix_set; /* [n_seqs] IntactKV prefix set (appends need it when prefix_len > 0) */
    const uint16_t *k16, *v16; /* exact region [n_seqs][H][n_exact][D] fp16 bits, keys post-RoPE */
    const uint32_t *kcodes; /* NUQ: [n_seqs][H][k_head_words][capq] (token-minor: coalesced per word);
                               KIVI: [n_seqs][H][capq/16][k_head_words][16] (tiles of 16 positions) */
    const uint32_t *vcodes; /* [n_seqs][H][capq][v_head_words] */
    const float *vscale;    /* NUQ: [n_seqs][capq][2] (zp, r) per token; KIVI: [n_seqs][H][capq][D/G][2] (min, scale) */
    const float *kscale;    /* KIVI: [n_seqs][capq/G][C][2] (min, scale); NUQ: NULL */
    const float *klut;      /* NUQ: [C][1 << k_bits] dequantized key per (channel, code) */
    const float *vlevels;   /* NUQ: [H][1 << v_bits] value levels per KV head (per-layer table repeated) */
    const uint8_t *k_zcode, *v_zcode; /* NUQ: [H] code stored at outlier positions (level nearest 0) */
    const uint32_t *krow, *vrow; /* NUQ: [n_seqs][H][capq + 1] sparse row pointers: token q of head h
                                    holds entries [row[q], row[q+1]) of that (sequence, head) */
    const uint32_t *kent, *vent; /* NUQ: [n_seqs][H][ent_cap] entries (d << 16 | fp16 bits), token order */
    size_t ent_cap;         /* entries allocated per (sequence, head) */
    const uint16_t *kring, *vring; /* KIVI: [n_seqs][ring][C] fp16 residual in the quantization domain */
    const double *inv_freq; /* [rope_dim / 2] */
} kvq_kvcache_view;
void kvq_kvcache_view_get(const kvq_kvcache *c, kvq_kvcache_view *v);

#endif
