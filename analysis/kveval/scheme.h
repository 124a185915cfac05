/* scheme.h — KV-cache quantization schemes as kveval names them: parse a spec
 * string, bind it to the calibration artifacts it needs, transform a layer's
 * K/V (quantize→dequantize, decode-equivalent), and account its bits and
 * cache size. The "Scheme" seam of docs/architecture.md, for evaluation.
 *
 * Spec grammar (the papers' table names):  BASE [+MODIFIER]...
 *   fp32                      no quantization (the baseline; no hook at all)
 *   fp16                      K/V rounded to IEEE half (what an fp16 cache holds)
 *   int<b>[-g<G>]             uniform asymmetric, per-token K and V; G channels per
 *                             (scale, zero) group, default the whole token
 *                             (all KV heads: the KVQuant intX baseline, App.P);
 *                             keys post-RoPE by default (App.P: better per-token)
 *   int<b>-pc[-<f>%]          uniform, per-channel keys with OFFLINE thresholds
 *                             (KVQuant App.G: the per-channel lower/upper of a
 *                             kvcalib artifact, method int-pc or nuq, fitted with
 *                             outlier fraction f — f > 0 keeps keys outside them
 *                             exact), per-token values (whole token); pre-RoPE keys
 *   kivi<b>[-g<G>][-r<R>]     KIVI (arXiv 2402.02750): keys per-channel in G-token
 *                             groups, values per-token in G-channel groups, an
 *                             R-token full-precision residual; defaults G = 32,
 *                             R = 128 (the KIVI paper's runs; notes §1.3); post-RoPE
 *   nuq<b>[-<f>%]             KVQuant nuqX (arXiv 2401.18079 §3): tables from a
 *                             kvcalib artifact of method nuq with k_bits = v_bits =
 *                             b and outlier fraction f/100 (nuq3-1% = 3 bits, 1%)
 *   fp8, e5m2                 vLLM's FP8 cache, E4M3FN / E5M2 (kernels/quant/quant_fp8.h:
 *                             round to nearest even, saturating), scale 1.0 (the
 *                             engine default without calibrated scales); post-RoPE
 *   fp8-tensor[-p<P>], fp8-head[-p<P>], e5m2-tensor[-p<P>], e5m2-head[-p<P>]
 *                             the same with per-layer-tensor / per-KV-head k/v
 *                             scales from a kvcalib artifact of method fp8 (that
 *                             format and granularity, percentile P, default 100 =
 *                             absmax; keys as the artifact, post-RoPE by default)
 *   q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl
 *                             llama.cpp's KV block formats (-ctk/-ctv;
 *                             kernels/quant/quant_ggml.h), 32-value blocks along
 *                             head_dim, post-RoPE keys. A head_dim that is not a
 *                             multiple of 32: binding fails with KVQ_EUNSUPPORTED
 *                             (llama.cpp refuses such caches; kveval skips the
 *                             scheme with a message)
 * Modifiers:
 *   +sink<N>                  first N tokens of every window exact (KVQuant §3.5);
 *                             default 0, or the artifact's n_sink for schemes
 *                             that read an artifact
 *   +pre-rope, +post-rope     which keys the scheme quantizes (overrides the
 *                             default above; artifact schemes must match the
 *                             artifact's key_position)
 *   +intactkv                 a full-precision prefix (IntactKV, issue 9) from an
 *                             artifact is attended before every window (never
 *                             quantized, never scored; window positions start
 *                             at P); error if no artifact holds one
 *   +artifact<N>              take tables / prefix from the N-th --artifact (1-based)
 *                             instead of the first matching one
 * Unknown names → KVQ_EINVAL listing the valid forms (kvq_scheme_syntax).
 *
 * One implementation. The built-in families (fp16, int, int-pc, kivi, nuq)
 * are "native": a bound scheme carries a kvq_kv_desc (kernels/schemes/kv_desc.h:
 * kind and parameters from its kvq_scheme, per-layer tables from its
 * artifact) and its transform IS kvq_kv_desc_transform — the same
 * description the CUDA forward runs natively (kvq_eval_scheme_kv_desc).
 * Families that kv_desc.h does not describe supply an apply function instead
 * (a host transform; on the GPU it runs on the CPU between layers).
 *
 * Decode equivalence. Every transform is a pure function of the rows it is
 * given and, per token, of that token and EARLIER tokens only, so that the
 * batched window equals token-by-token decoding with a real quantized cache:
 *  - fp16, int, int-pc, nuq, fp8 and llama.cpp formats: each token's reconstruction depends on the token
 *    alone (per-token ranges are the token's own; per-channel ranges and fp8
 *    scales are offline; block scales are per 32 values of the token's own
 *    head): transform in place; query t sees its own K/V quantized too
 *    (KVQuant quantizes the diagonal).
 *  - kivi: a token's representation changes with the query position; the
 *    window keeps exact K/V and the quantized ones go to kvq_kv_alt with the
 *    boundaries kvq_kivi_key_boundary / kvq_kivi_value_boundary (query t sees
 *    key groups flushed before step t quantized, the last R values exact).
 *
 * Extending (issue 13: fp8, llama.cpp block formats): add a kvq_scheme_family
 * to the table in scheme.c — a parse function for its base names, its
 * default key stage, what artifact it needs (match), the transform (apply:
 * a host transform, unless kv_desc.h learns the format and the family turns
 * native) and the bits accounting. Nothing else in kveval changes.
 */
#ifndef KVQ_SCHEME_H
#define KVQ_SCHEME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "artifact.h"
#include "forward.h"
#include "kv_desc.h"
#include "model.h"
#include "quant.h"
#include "status.h"

#define KVQ_SPEC_MAX 128

typedef struct kvq_scheme_family kvq_scheme_family;

/* A parsed spec, not yet bound to artifacts. */
typedef struct {
    char spec[KVQ_SPEC_MAX];       /* the string as given */
    const kvq_scheme_family *fam;  /* registry entry */
    kvq_scheme q;                  /* quantizer parameters (kernels/quant/quant.h) */
    int variant;                   /* family-specific sub-format: fp8 families KVQ_FP8_* (+ 2 for per-head
                                      scales); llama.cpp formats the kvq_ggml_type; 0 otherwise */
    double percentile;             /* fp8-tensor / fp8-head: the artifact's percentile (100 = absmax); 0 otherwise */
    kvq_key_stage key_stage;       /* resolved: the family default or the modifier */
    bool stage_set;                /* +pre-rope / +post-rope given */
    bool sink_set;                 /* +sink<N> given */
    bool intactkv;                 /* +intactkv */
    int artifact_index;            /* +artifact<N>: 1-based index into the artifact set, 0 = auto */
} kvq_scheme_spec;

/* Parse a spec (grammar above). Errors (KVQ_EINVAL) quote the spec and name
 * the offending part; an unknown base lists the valid forms. */
kvq_status kvq_scheme_parse(const char *spec, kvq_scheme_spec *out, kvq_err *err);

/* One line listing the valid forms (for --help and errors). */
const char *kvq_scheme_syntax(void);

/* ---- artifacts --------------------------------------------------------- */

/* A full-precision prefix read from an artifact's reserved tensors
 * (ARTIFACT.md): intactkv.token_ids I32 [P], layers.<i>.intactkv.k / .v F32
 * [P, kv_dim] (post-RoPE keys at positions 0..P-1, values). */
typedef struct {
    int P;              /* 0 = the artifact holds none */
    int32_t *token_ids; /* [P] */
    float *k, *v;       /* [n_layers][P][kv_dim] */
} kvq_eval_prefix;

/* The --artifact files of a run, read and checked against the model. */
typedef struct {
    size_t n;
    kvq_artifact *a;          /* [n] */
    kvq_eval_prefix *prefix;  /* [n] */
    char (*path)[4096];       /* [n] */
    kvq_kv_layer_tables **tables; /* [n][n_layers]: descriptor views (kv_desc.h) of a[i]'s per-layer
                                   * tables (pointers into a[i]; zeroed where it has none) */
} kvq_artifact_set;

/* Read every path (kvq_artifact_read: schema too new → KVQ_EUNSUPPORTED),
 * check it belongs to the model (kvq_artifact_check_model against
 * model_fingerprint → KVQ_EMISMATCH naming both; then n_layers, n_kv_heads,
 * head_dim) and read its prefix if present. allow_mismatch: a fingerprint
 * mismatch is a warning on `warn` instead (shapes must still agree). Errors are prefixed with the
 * path. On failure nothing stays allocated. */
kvq_status kvq_artifact_set_load(kvq_artifact_set *set, const char *const *paths, size_t n, const kvq_model *m,
                                 const char *model_fingerprint, bool allow_mismatch, FILE *warn, kvq_err *err);
void kvq_artifact_set_free(kvq_artifact_set *set);

/* ---- bound schemes ------------------------------------------------------ */

/* A spec bound to its tables and prefix (pointers into the artifact set,
 * which must outlive it). Read-only during evaluation. */
typedef struct {
    kvq_scheme_spec s;
    char name[KVQ_SPEC_MAX + 32];  /* canonical: "nuq3-1%+sink1", "kivi2-g32-r128" */
    const kvq_artifact *art;       /* tables, or NULL */
    int art_index;                 /* 0-based index in the set, -1 = none */
    const char *art_path;
    const kvq_eval_prefix *prefix; /* +intactkv, else NULL */
    int prefix_index;              /* -1 = none */
    size_t head_dim;
    kvq_kv_desc desc;              /* native families: the transform as data (q, key stage, the
                                    * artifact set's tables), validated at bind; else zeroed */
} kvq_eval_scheme;

/* Bind a parsed spec: choose the artifact (the +artifact<N> one, else the
 * first whose parameters match), take its n_sink unless +sink was given,
 * check group sizes against the model, and for a native family build and
 * validate the descriptor (kvq_kv_desc_validate). Errors: a scheme that needs an
 * artifact without one ("nuq3-1% needs a kvcalib artifact of method nuq with
 * 3 bits and 1% outliers; none given / none of the 2 given matches: ..."),
 * +intactkv without a prefix, sizes that do not divide. */
kvq_status kvq_eval_scheme_bind(const kvq_scheme_spec *spec, const kvq_artifact_set *set, const kvq_hparams *hp,
                                kvq_eval_scheme *out, kvq_err *err);

/* Parse + bind. */
kvq_status kvq_eval_scheme_make(const char *spec, const kvq_artifact_set *set, const kvq_hparams *hp,
                                kvq_eval_scheme *out, kvq_err *err);

/* True when the scheme changes nothing (fp32 without a prefix): evaluate it
 * with no hooks. */
bool kvq_eval_scheme_is_identity(const kvq_eval_scheme *s);

/* The scheme's descriptor when its transform is kvq_kv_desc_transform (a
 * native family without an apply override), for kvq_engine_set_kv /
 * kvq_forward_cuda_set_kv; NULL when it needs a host transform (the family's
 * apply) or none at all (fp32). Points into s. */
const kvq_kv_desc *kvq_eval_scheme_kv_desc(const kvq_eval_scheme *s);

/* Code bits of K and V for the table: 32 / 16 for fp32 / fp16. */
int kvq_eval_scheme_code_bits(const kvq_eval_scheme *s, char kv);

/* Effective bits per element of K and V in a cache holding ctx window
 * tokens (kvq_scheme_bits: KVQuant App.M accounting — fp16 scales and zero
 * points, outliers as 16-bit value + 16-bit index + 32-bit row pointer per
 * token, sink and KIVI residual tokens at 16 bits), plus the +intactkv prefix
 * (P tokens at 16 bits; 32 for fp32), averaged over ctx + P tokens. */
kvq_status kvq_eval_scheme_bits(const kvq_eval_scheme *s, size_t ctx, const kvq_hparams *hp, kvq_bits *out,
                                kvq_err *err);

/* KV cache size in MiB (2^20 bytes) of one sequence of ctx window tokens
 * (+ prefix): n_layers * (ctx + P) * kv_dim * (bits.k + bits.v) / 8 / 2^20. */
double kvq_eval_scheme_cache_mib(const kvq_eval_scheme *s, const kvq_bits *bits, size_t ctx, const kvq_hparams *hp);

/* ---- the transform hook --------------------------------------------------- */

/* Per-run state of a scheme's hook (counters accumulate over layers/windows). */
typedef struct {
    const kvq_eval_scheme *s;
    kvq_quant_counts k_counts, v_counts;
    double seconds;  /* wall time spent inside the transform (quantization simulation) */
} kvq_scheme_run;

/* Fill hooks for the forward: transform = the scheme's, key_stage as the
 * scheme says, user = run (which must outlive the forward calls). */
void kvq_scheme_hooks(kvq_scheme_run *run, const kvq_eval_scheme *s, kvq_hooks *hooks);

/* The transform callback itself (kvq_hooks.transform signature; user is a
 * kvq_scheme_run): the family's apply if it has one, else
 * kvq_kv_desc_transform on the scheme's descriptor (counters into run).
 * Timed into run->seconds. Exposed for tests. */
kvq_status kvq_scheme_transform(void *user, const kvq_layer_ctx *ctx, float *k, float *v, kvq_kv_alt *alt,
                                kvq_err *err);

/* ---- registry ----------------------------------------------------------- */

struct kvq_scheme_family {
    const char *name;    /* "int", "kivi", ... */
    const char *syntax;  /* "int<b>[-g<G>]" */
    /* Parse the base name; return 0 if it is not this family's, 1 on
     * success (fill spec->q / variant), -1 on a malformed name of this family
     * (err filled). */
    int (*parse)(const char *base, kvq_scheme_spec *spec, kvq_err *err);
    kvq_key_stage default_stage;
    /* Artifact need: NULL = none. Otherwise returns true if params can serve
     * the spec (method, bits, outlier fraction, key position). */
    bool (*match)(const kvq_scheme_spec *spec, const kvq_artifact_params *p);
    /* Describe the need for error messages ("a kvcalib artifact of method nuq with 3 bits and 1% outliers"). */
    void (*describe_need)(const kvq_scheme_spec *spec, char *buf, size_t n);
    /* Extra checks against the model (divisibility); may be NULL. */
    kvq_status (*check)(const kvq_eval_scheme *s, const kvq_hparams *hp, kvq_err *err);
    /* Canonical base name into buf. */
    void (*format)(const kvq_scheme_spec *spec, char *buf, size_t n);
    /* Host transform of one layer's window K/V (see kvq_scheme_transform), for
     * families kv_desc.h does not describe; NULL = native (below) or identity.
     * When set it takes precedence over native. */
    kvq_status (*apply)(kvq_scheme_run *run, const kvq_layer_ctx *ctx, float *k, float *v, kvq_kv_alt *alt,
                        kvq_err *err);
    /* Effective bits per element over ctx window tokens (no prefix). */
    kvq_status (*bits)(const kvq_eval_scheme *s, size_t ctx, size_t kv_dim, kvq_bits *out, kvq_err *err);
    /* Code bits of 'k' or 'v' for the table. */
    int (*code_bits)(const kvq_eval_scheme *s, char kv);
    /* The transform is the descriptor's (kv_desc.h: spec->q.kind is one of
     * its built-in kinds) and apply is NULL; false for host transforms. */
    bool native;
};

/* The registry, in listing order; *n receives its length. */
const kvq_scheme_family *kvq_scheme_families(size_t *n);

#endif
