/* family.h — the scheme seam: one descriptor per KV-cache method family.
 *
 * A family (KVQuant nuqX, KIVI, uniform intX, FP8, llama.cpp block formats,
 * heavy-hitter mixed precision, ...) is ONE `kvq_family` value with named
 * fields, in the spirit of ggml's type_traits table, defined in its own file
 * kernels/schemes/<family>.c (+ <family>_cuda.cu for a native GPU transform)
 * and listed once in kernels/schemes/registry.c. Everything that names a
 * scheme derives from that registry:
 *   - kveval --scheme specs (scheme.h: parse, bind to an artifact, canonical
 *     name, bits accounting, cache size) and every --help list of them;
 *   - kvcalib --method (calib/calibrate.h drives a family's `calib` part over
 *     a dump) and the artifact's kvq.method, its tensors, validation and
 *     --inspect text (artifact.h: a family's `artifact` part);
 *   - kvstat's quantization error (analysis/kvstat: the family's `quantize`);
 *   - the CPU forward's transform hook (kv_desc.h: `transform` / `quantize`),
 *     the CUDA forward's native transform (`cuda`), the runtime packed cache
 *     (`kvcache_config`).
 * Adding a family = its file(s) + one registry line + its tests
 * (docs/architecture.md, "Adding a method", walks through kernels/schemes/hh.c).
 *
 * The cache-simulation contract (what `transform` may produce for one layer
 * and one window of T tokens; kernels/model/forward.h, kvq_kv_alt):
 *   1. in place: k, v [T][n_kv_heads][head_dim] replaced by what the cache
 *      holds for every query (a token's representation never changes);
 *   2. an alternative with per-query boundaries (alt->k/v + k_bound/v_bound,
 *      uniform over heads): query i reads window key j as the alternative when
 *      j < k_bound[i], else the primary (KIVI's group flush and value window);
 *   3. a per-key schedule (alt->sched, kvq_kv_sched): up to KVQ_KV_MAX_REPS
 *      representations per key and value, each (KV head, token) switching to
 *      its next representation at a query step of its own (MiKV/H2O-style
 *      demotion, recent windows, several precisions), optionally decided from
 *      the attention the simulated cache itself produced at earlier steps (a
 *      `step` callback after every query row). The forward then attends query
 *      rows in order (kvq_attention_sched: same O(T^2) work as attention).
 *      Its selection form (k_sel / v_sel) lets a step move a token to any of up
 *      to KVQ_KV_MAX_REPS representations, also back (QAQ's per-token widths).
 *      A step the device should run itself is described declaratively:
 *      forward.h kvq_sched_imp (switch times: importance.h's policy) or
 *      kvq_sched_sel (selections by a width threshold rule: qaq.c); the CUDA
 *      forward then attends the layer and decides on the GPU.
 *   4. a window in steps (chunk / cache below; kvq_hooks.chunk): the engine
 *      runs the window as calls of at most `chunk` tokens, each attending the
 *      cache the family built for the tokens before it as a prefix; within a
 *      call the transform uses forms 1-3. For a cache entry of token j that
 *      depends on states computed after j's own layer call (cross-layer
 *      merging: layer l holds a state shared with layer l+1, which exists
 *      only once j has passed layer l+1); chunk 1 is a token-by-token decode.
 * Families may carry state across the layers of a window (layers are called
 * in order 0..n_layers-1 for every window; kvq_kv_desc_run.state) and apply
 * per-layer transforms shared by all tokens (projections, permutations,
 * rotations) inside `quantize`/`transform`. Every form must stay
 * decode-equivalent: what query i reads depends only on tokens <= i and on
 * decisions taken at steps < i (tests/test_kveval.c holds the step-by-step
 * cache-loop oracles).
 *
 * The generic rotation (kvq_kv_desc.rot: the +hadamard / +rht modifiers) is
 * no family's code: kv_desc.c rotates each head vector of the window (keys in
 * the descriptor's stage, values) before the family's transform / quantize
 * and un-rotates every output after it (in place, the alternatives, each
 * distinct schedule buffer). Per-token and orthonormal, it keeps every form
 * decode-equivalent. On the GPU a rotated descriptor runs on the host path
 * (kvq_kv_desc_cuda is NULL for it).
 *
 * Layout of every tensor: one layer's keys or values x[n_tokens][kv_dim],
 * row-major fp32, kv_dim = n_kv_heads * head_dim, channel c = h*head_dim + d.
 */
#ifndef KVQ_FAMILY_H
#define KVQ_FAMILY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "artifact.h"
#include "forward.h"
#include "hadamard.h"
#include "kmeans.h"
#include "kvcache.h"
#include "quant.h"
#include "status.h"

typedef struct kvq_family kvq_family;

/* ---- a scheme: a family and its parameters ------------------------------ */

#define KVQ_SCHEME_X 4
#ifndef __cplusplus
_Static_assert(KVQ_SCHEME_X == KVQ_ARTIFACT_X, "family parameters: a scheme and an artifact hold the same number");
#endif

typedef struct kvq_scheme {
    const kvq_family *fam; /* the family (NULL only in a zeroed struct) */
    int k_bits, v_bits;    /* code bits, 1..8 (ignored for fp32/fp16; fp8: 8; llama.cpp: the format's code bits) */
    double outlier_frac;   /* [0, 0.5): total fraction of sparse outliers (nuq, int-pc) */
    size_t n_sink;         /* tokens kept at full precision at the start of each sequence (attention sink) */
    size_t group;          /* int / int-pc values: channels per (scale, zero) group (0 = whole token); kivi: G;
                              hh: channels per group of the low/high-precision per-token quantizer */
    size_t residual;       /* kivi: R; hh: the exact recent window */
    int variant;           /* family sub-format: fp8 KVQ_FP8_* (+2 per-head scales, +4 artifact scales);
                              llama.cpp the kvq_ggml_type; 0 otherwise */
    double percentile;     /* fp8 with artifact scales: the artifact's percentile (100 = absmax) */
    double x[KVQ_SCHEME_X];/* family-specific parameters, named in the family's file */
} kvq_scheme;

/* Check a scheme's parameters (generic ranges, then the family's rules); the
 * error names the field ("k_bits: expected 1..8, found 9"). */
kvq_status kvq_scheme_validate(const kvq_scheme *s, kvq_err *err);

/* Effective bits per element, K and V separately. */
typedef struct {
    double k, v;  /* effective bits per element */
    double mean;  /* (k + v) / 2 */
} kvq_bits;

/* Inputs of a family's bits accounting. */
typedef struct {
    size_t ctx;                      /* cache tokens (window tokens, prefix excluded), > 0 */
    size_t kv_dim;                   /* > 0 */
    size_t head_dim;                 /* 0 = unknown (fp8 per-head scales then fail with KVQ_EINVAL) */
    size_t n_layers;                 /* the model's layers, 0 = unknown (per-layer policies: turboquant's
                                        uncompressed boundary layers are then left out of the accounting) */
    const kvq_quant_counts *k, *v;   /* counts a run realised (outliers, high-precision tokens), or NULL:
                                        the nominal accounting from the parameters alone */
} kvq_bits_in;

/* Effective bits per element of a cache of ctx tokens (the family's
 * accounting; KVQuant App.M conventions: fp16 scales and zero points, sparse
 * outliers as 16-bit value + 16-bit index + a 32-bit row pointer per token,
 * sink / residual tokens at 16 bits). Nominal (no realised counts).
 * Requires ctx > 0, kv_dim > 0. */
kvq_status kvq_scheme_bits(const kvq_scheme *s, size_t ctx, size_t kv_dim, kvq_bits *out, kvq_err *err);
/* The same with head_dim and optional realised counts (kvq_bits_in). */
kvq_status kvq_scheme_bits_ex(const kvq_scheme *s, const kvq_bits_in *in, kvq_bits *out, kvq_err *err);

/* ---- a bound scheme as the engines see it ---------------------------------- */

/* Tables of one layer (pointers borrowed from an artifact; must outlive every use). */
typedef struct {
    const float *k_lower, *k_upper; /* [kv_dim] per-channel key thresholds (int-pc, nuq), else NULL */
    kvq_nuq_lut k_lut, v_lut;       /* nuq levels (bits == the scheme's k_bits / v_bits), else zeroed */
} kvq_kv_layer_tables;

/* A scheme bound to its tables: what the CPU hook, the CUDA forward, kvstat
 * and the runtime-cache reference run. Built by kvq_eval_scheme_bind
 * (scheme.h) or by hand (tests). */
typedef struct kvq_kv_desc {
    kvq_scheme q;                      /* family and parameters */
    kvq_key_stage key_stage;           /* which keys are quantized */
    kvq_rotation rot;                  /* +hadamard / +rht (hadamard.h): every family, generically (kv_desc.c): each
                                        * cached key / value head vector x is held as Q(x·R) and read back as
                                        * Q(x·R)·Rᵀ, keys in key_stage; zero = none */
    const kvq_kv_layer_tables *layers; /* [n_layers] views of the artifact's tables (int-pc, nuq), else NULL */
    int n_layers;                      /* entries of layers (0 when NULL) */
    const kvq_artifact *art;           /* the artifact of the tables (fp8 scales, ...), or NULL */
} kvq_kv_desc;

/* Per-run state of a descriptor's transform: counters accumulated (+=) over
 * layers and windows, and the family's own state (kvq_kv_desc_run_init /
 * _free; layers arrive in order 0..n_layers-1 within a window). */
typedef struct kvq_kv_desc_run {
    const kvq_kv_desc *d;
    kvq_quant_counts k_counts, v_counts;
    void *state;  /* owned by the family (run_init / run_free), NULL for stateless families */
} kvq_kv_desc_run;

/* ---- the family descriptor ------------------------------------------------ */

/* How a family stores its tables in a calibration artifact (ARTIFACT.md). */
typedef struct {
    bool k_levels, v_levels;   /* layers.<i>.{k,v}.levels + fit_objective + fit_chosen (nuq datatypes) */
    bool v_levels_fp16;        /* the value levels are an fp16 LUT: the reader rounds them to fp16 (nuq: KVQuant App. M) */
    bool k_thresholds;         /* layers.<i>.k.channel_lower / channel_upper */
    bool fp8_scales;           /* layers.<i>.{k,v}.fp8_scale + kvq.fp8_format, kvq.fp8_percentile: one float32 scale
                                  per layer tensor or KV head (fp8's k/v scale; nvfp4's per-tensor scale) */
    bool vllm_export;          /* kvcalib export-vllm takes it: the fp8_scale are vLLM FP8 k_scale / v_scale (fp8) */
    bool outliers;             /* kvq.outlier_fraction may be > 0 */
    bool per_head;             /* kvq.granularity per-head applies (datatypes or scales) */
    bool post_rope_only;       /* readers take the keys as post-RoPE whatever kvq.key_position says (int, kivi) */
    const char *k_axis, *v_axis, *k_scaling, *v_scaling; /* descriptive metadata */
    /* method-specific rules on the parameters (group size, residual length, fp8 fields); NULL = none */
    kvq_status (*check_params)(const kvq_artifact_params *p, kvq_err *err);
    /* method lines of kvcalib --inspect (after "sink tokens"); NULL = none */
    void (*inspect)(FILE *f, const kvq_artifact_params *p);
    /* the family's own per-(layer, side) tables (artifact.h kvq_fam_tensor): NULL-terminated names of
     * the tables stored for side 'k' / 'v' under parameters p (NULL or an empty list = none). Every
     * listed table is required; the writer stores and the reader loads exactly these. */
    const char *const *(*tensors)(const kvq_artifact_params *p, char side);
    /* shapes and values of those tables (called by kvq_artifact_validate per layer and side with a
     * non-empty list); errors name the tensor ("layers.3.k.smooth[17]: expected > 0, found 0"). */
    kvq_status (*check_tensors)(const kvq_artifact_params *p, size_t layer, char side, const kvq_kv_table *t,
                                kvq_err *err);
    /* names of the family's parameters p->x[0..] (NULL-terminated, at most KVQ_ARTIFACT_X): stored as
     * metadata "kvq.<method>.<name>" (%.17g) and set by kvcalib --param NAME=VALUE */
    const char *const *params;
} kvq_family_artifact;

/* One (layer, K|V) tensor of a dump, as a family's fit receives it. */
typedef struct {
    const float *x;        /* [n_tokens][kv_dim]: samples concatenated */
    const float *fisher;   /* [n_tokens][kv_dim] squared gradients, or NULL */
    size_t n_tokens;
    size_t sample_len;     /* tokens per sample (sink tokens are the first n_sink of each) */
    size_t n_kv_heads, head_dim;
    kvq_kmeans_opts fit;   /* datatype fit (nuq) */
} kvq_fit_input;

/* Read access to the whole dump for a family's layer fit (calib/calibrate.c fills it). */
typedef struct kvq_calib_src {
    void *ctx;
    size_t n_samples, seq_len;      /* rows = n_samples * seq_len tokens (samples concatenated) */
    size_t n_layers, n_heads, n_kv_heads, head_dim, rope_dim;
    bool has_q, has_fisher, has_attn_stats;
    /* Read dataset `ds` (formats/dump.h kvq_dump_ds: 0 k_pre_rope, 1 k, 2 v, 3 q, 4 fisher_k_pre_rope,
     * 5 fisher_v, 6 attn_received, 7 attn_entropy) of `layer` (any layer, not only the one being fitted)
     * into buf, all samples: [rows][n_kv_heads * head_dim] (k, v, Fisher), [rows][n_heads * head_dim] (q),
     * [n_samples][n_heads][seq_len] (attention statistics). Values checked finite (Fisher >= 0).
     * Errors name the dump, layer and dataset (missing dataset: KVQ_EINVAL with the kvdump option). */
    kvq_status (*read)(const struct kvq_calib_src *src, int layer, int ds, float *buf, kvq_err *err);
} kvq_calib_src;

/* Floats kvq_calib_src.read writes for dataset ds (0 for an unknown ds). */
size_t kvq_calib_src_len(const kvq_calib_src *src, int ds);

/* How kvcalib calibrates a family from a dump (calib/calibrate.h). */
typedef struct {
    /* kvcalib option defaults (the papers' settings) */
    int bits;                  /* --bits */
    double outliers;           /* --outliers */
    size_t sink, group, residual;
    bool post_rope;            /* --keys */
    bool fisher;               /* Fisher-weighted fit by default */
    double fp8_percentile;     /* fp8, nvfp4: 100 = absmax; 0 for other families */
    /* which options apply (others are refused, naming the method) */
    bool pre_rope_ok;          /* --keys pre-rope */
    bool fisher_opt, fit_opt;  /* Fisher weights; --fit / --seed (nuq datatypes) */
    bool group_opt, residual_opt;
    bool fp8_opt;              /* calibrated scales (fp8_scales): --scale, --percentile; --bits fixed at `bits` */
    bool fp8_format_opt;       /* --fp8-format e4m3|e5m2 (fp8) */
    bool bits_free;            /* the tables do not depend on code bits (lowrank: the kveval spec picks the coefficient
                                  bits): --bits refused, `bits` stored as the artifact's k_bits / v_bits */
    /* work items: (layer, K) and (layer, V) tensors fitted (neither: the metadata is the whole artifact) */
    bool fit_k, fit_v;
    /* fit one (layer, side) table from the dump's tensor (keys pre- or post-RoPE per p->post_rope) */
    kvq_status (*fit)(const kvq_artifact_params *p, char side, const kvq_fit_input *in, kvq_kv_table *out, kvq_err *err);
    /* instead of fit: one layer's key and value tables at once, reading whatever the family needs
     * (queries, Fisher information, attention statistics, neighbouring layers) through src; k / v are
     * the layer's zeroed tables (NULL when fit_k / fit_v is false). Layers run in parallel (OpenMP);
     * results must not depend on the order. */
    kvq_status (*fit_layer)(const kvq_artifact_params *p, int layer, const kvq_calib_src *src, kvq_kv_table *k,
                            kvq_kv_table *v, kvq_err *err);
    /* after every layer (optional): decisions across layers (which layers to merge, a global budget),
     * with the tables of all layers in a (a->k / a->v [n_layers]) */
    kvq_status (*finish)(const kvq_artifact_params *p, const kvq_calib_src *src, kvq_artifact *a, kvq_err *err);
    /* defaults of the family's parameters p->x (named by artifact->params) */
    double x[KVQ_ARTIFACT_X];
} kvq_family_calib;

/* Arguments of a native CUDA transform of one layer (all pointers on the device). */
typedef struct {
    int layer, T, n_kv_heads, head_dim;
    size_t kv_dim;
    const float *k_src, *v_src;   /* [T][kv_dim]: keys in the descriptor's stage, values (read only) */
    float *k, *v;                 /* in-place outputs: hold copies of k_src / v_src on entry */
    float *k_alt, *v_alt;         /* alternative outputs (families with cuda->alt) */
    unsigned long long *counters; /* [4]: key, value outliers; key, value clipped (quant.h n_clipped) (added) */
    void *stream;                 /* cudaStream_t */
} kvq_cu_kv_args;

/* A family's native CUDA transform (kernels/schemes/<family>_cuda.cu). */
typedef struct {
    bool alt;  /* writes k_alt / v_alt read with the family's alt_bounds; else k / v in place */
    /* upload the descriptor's tables; *state (may stay NULL) is passed to transform and release */
    kvq_status (*upload)(const kvq_kv_desc *d, const kvq_hparams *hp, void **state, kvq_err *err);
    void (*release)(void *state);
    kvq_status (*transform)(const kvq_kv_desc *d, const void *state, const kvq_cu_kv_args *a, kvq_err *err);
} kvq_family_cuda;

/* Receives a family's named parameters (kvq_family.describe). */
typedef struct kvq_param_sink {
    void *ctx;
    void (*num)(void *ctx, const char *key, double value);
    void (*str)(void *ctx, const char *key, const char *value);
} kvq_param_sink;

struct kvq_family {
    /* identity */
    const char *name;          /* kvcalib --method, the artifact's kvq.method, kvstat labels */
    const char *syntax;        /* kveval spec forms, e.g. "nuq<b>[-<f>%]" (listed in --help and errors) */
    const char *summary;       /* one line: what it is and its source */
    kvq_key_stage default_stage;
    bool stage_free;           /* the key stage changes nothing (fp32, fp16): +pre-rope / +post-rope refused */
    bool identity;             /* fp32: no transform, no hook */
    bool key_outliers_online;  /* key outliers chosen per token at write time (a fixed count per row, qaq), not by offline
                                  thresholds: kveval's "realised share far above the nominal" warning does not apply */

    /* spec */
    /* parse a base name: 0 = not this family's, 1 = parsed (q filled), -1 = malformed (err filled) */
    int (*parse)(const char *base, const char *spec, kvq_scheme *q, kvq_err *err);
    void (*format)(const kvq_scheme *q, char *buf, size_t n);        /* canonical base name */
    kvq_status (*validate)(const kvq_scheme *q, kvq_err *err);       /* parameter rules; NULL = generic only */
    /* sizes against the model (divisibility); NULL = none. Errors name the scheme (spec). */
    kvq_status (*check_model)(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err);
    /* sizes against the evaluation's context of ctx tokens (a window longer than the context); NULL = none.
     * Called by kveval's perplexity run (ctx) and passkey task (every --passkey-lengths value) before any work;
     * `name` is the scheme's canonical name. */
    kvq_status (*check_ctx)(const kvq_scheme *q, const char *name, size_t ctx, kvq_err *err);

    /* artifacts */
    bool (*needs_artifact)(const kvq_scheme *q);  /* NULL: never */
    /* can the artifact with params p serve the spec (stage given by +pre-rope/+post-rope when stage_set)? */
    bool (*match)(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p);
    void (*describe_need)(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n);
    /* after binding: take what the scheme reads from the artifact (n_sink is handled generically) */
    void (*bind_params)(kvq_scheme *q, const kvq_artifact_params *p);
    /* the artifact's own scheme (kvstat, kvcalib intactkv --train); NULL: not an artifact method */
    void (*from_params)(const kvq_artifact_params *p, kvq_scheme *q);
    /* the descriptor's tables are present and sane (kvq_kv_desc_validate); NULL = needs none */
    kvq_status (*check_tables)(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err);
    const kvq_family_artifact *artifact; /* NULL: kvcalib writes no artifact of this family */
    const kvq_family_calib *calib;       /* NULL: kvcalib cannot calibrate it */

    /* simulation */
    /* one side ('k' or 'v') of one layer, as the cache holds it at rest: out[n_tokens][kv_dim]
     * (out may equal in). kvstat's quantization error, the in-place transform, the runtime-cache
     * reference. NULL only for the identity. */
    kvq_status (*quantize)(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t n_tokens,
                           size_t kv_dim, size_t head_dim, kvq_quant_counts *c, kvq_err *err);
    /* the hook (contract above); NULL = quantize both sides in place */
    kvq_status (*transform)(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt,
                            kvq_err *err);
    /* families whose transform gives alternatives with per-query boundaries: kb/vb [T] (<= i + 1) */
    void (*alt_bounds)(const kvq_scheme *q, size_t T, int *kb, int *vb);
    kvq_status (*run_init)(kvq_kv_desc_run *run, kvq_err *err); /* NULL: stateless */
    /* a window in steps (forward.h kvq_hooks.chunk, "the cache-simulation contract" 4): tokens per step
     * (> 0), or 0 for the whole window at once; NULL = 0 */
    int (*chunk)(const kvq_scheme *q);
    /* with chunk: the cache the run built for the first P window tokens, per layer P post-RoPE keys and
     * values (out->k / v [n_layers][P][kv_dim] owned by the run state, valid until the next call) */
    kvq_status (*cache)(kvq_kv_desc_run *run, int P, kvq_prefix *out, kvq_err *err);
    void (*run_free)(kvq_kv_desc_run *run);
    bool no_backward;          /* the transform has no straight-through backward (schedules) */

    /* the family's own parameters for reports (kveval's JSON): num / str are called per parameter;
     * NULL = none beyond the common ones (bits, n_sink, key stage, outlier fraction) */
    void (*describe)(const kvq_scheme *q, bool has_artifact, kvq_param_sink *out);

    /* bits */
    kvq_status (*bits)(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err);
    int (*code_bits)(const kvq_scheme *q, char side);   /* NULL: k_bits / v_bits */

    /* devices */
    const kvq_family_cuda *cuda; /* native CUDA transform; NULL: on the GPU the transform runs on the host */
    /* the runtime packed cache (kernels/kvcache) for layer `layer` of an artifact; NULL = none */
    kvq_status (*kvcache_config)(kvq_kvcache_config *cfg, const kvq_artifact *a, size_t layer, kvq_err *err);
};

/* ---- the registry (registry.c) ---------------------------------------------- */

/* All families in listing order; *n receives the count. */
const kvq_family *const *kvq_families(size_t *n);
/* The family named `name` ("nuq", "kivi", ...), or NULL. */
const kvq_family *kvq_family_find(const char *name);
#define KVQ_FAM(name) kvq_family_find(name)
/* The family kvcalib writes as method `name` (one with an artifact part), or NULL. */
const kvq_family *kvq_family_method(const char *name);
/* "nuq|int|int-pc|kivi|fp8": the methods kvcalib calibrates, joined by sep. Returns buf. */
const char *kvq_family_methods(const char *sep, char *buf, size_t n);
/* Families whose artifact part has `flag` set (offsetof a bool in kvq_family_artifact), joined as
 * "nuq and int-pc"; for messages that list who supports an option. Returns buf. */
const char *kvq_family_list_artifact_flag(size_t flag_offset, char *buf, size_t n);
const char *kvq_family_list_calib_flag(size_t flag_offset, char *buf, size_t n);

/* ---- helpers for family files ---------------------------------------------- */

/* Unsigned decimal at *p (no sign), advancing *p; false if no digit or above max. */
bool kvq_spec_uint(const char **p, unsigned long max, unsigned long *out);
/* "<f>%" with 0 < f < 50: *frac = f / 100, advancing *p. */
bool kvq_spec_percent(const char **p, double *frac);
/* "<prefix><b>" at *p: 0 = not this prefix followed by a digit; 1 = bits in *bits (1..8);
 * -1 = a bad bit count (err: "scheme '<spec>': bits: expected 1..8"). */
int kvq_spec_bits(const char **p, const char *prefix, const char *spec, unsigned long *bits, kvq_err *err);
/* kvq_fail(err, KVQ_EINVAL, "scheme '<spec>': <what>") and -1 (for parse functions). */
int kvq_spec_bad(const char *spec, kvq_err *err, const char *what);
bool kvq_spec_starts(const char *s, const char *prefix);
/* "-<f>%" for frac > 0, else "". */
void kvq_spec_fmt_pct(char *buf, size_t n, double frac);

/* ((ctx - n16) * dense + n16 * 16) / ctx with n16 clipped to ctx: a cache whose first n16 tokens are
 * fp16 (sink, residual) and the rest at `dense` bits per element. */
double kvq_bits_mix16(double dense, size_t ctx, size_t n16);

/* A per-side fit's input without each sample's first n_sink rows: compacts in->x in place (the driver's
 * buffer, the fit's to use) and returns the rows left (fp8's and nvfp4's scale fits). */
size_t kvq_fit_drop_sink(const kvq_fit_input *in, size_t n_sink);

/* The share of the quantized elements (not sink, not exact for other reasons) a run kept as sparse
 * outliers, counted in c; the nominal fraction when there are no counts, no such elements or no
 * nominal fraction (nominal <= 0). The bits of nuq / int-pc and kveval's outlier warning use it. */
double kvq_bits_outlier_frac(const kvq_quant_counts *c, double nominal);

/* Apply a family's quantize to both sides of a window in place (the default transform):
 * run->k_counts / v_counts accumulate. */
kvq_status kvq_family_transform_in_place(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v,
                                         kvq_err *err);

/* Does the family's CUDA build exist (KVQ_CUDA)? Family files name their cuda part with this:
 *   #ifdef KVQ_CUDA  extern const kvq_family_cuda kvq_nuq_cuda;  #endif
 *   .cuda = KVQ_FAMILY_CUDA(kvq_nuq_cuda), */
#ifdef KVQ_CUDA
#define KVQ_FAMILY_CUDA(sym) (&(sym))
#else
#define KVQ_FAMILY_CUDA(sym) NULL
#endif

#endif
