/* scheme.h — KV-cache quantization schemes as the tools name them: parse a
 * spec string, bind it to the calibration artifacts it needs, run its
 * transform (quantize→dequantize, decode-equivalent), and account its bits
 * and cache size. The consumer side of the scheme seam (family.h): every
 * family in kernels/schemes/registry.c is a valid BASE.
 *
 * Spec grammar (the papers' table names):  BASE [+MODIFIER]...
 *   BASE: one of the families' forms (kvq_scheme_syntax(); family.h `syntax`), e.g.
 *   fp32, fp16                no quantization / K/V rounded to IEEE half
 *   int<b>[-g<G>]             uniform asymmetric per-token K and V (KVQuant App.P)
 *   int<b>-pc[-<f>%]          per-channel keys with OFFLINE thresholds from an int-pc or nuq artifact
 *   kivi<b>[-g<G>][-r<R>]     KIVI (arXiv 2402.02750), defaults G = 32, R = 128
 *   nuq<b>[-<f>%]             KVQuant nuqX (arXiv 2401.18079 §3), tables from an nuq artifact
 *   fp8, e5m2, {fp8,e5m2}-{tensor,head}[-p<P>]   vLLM's FP8 cache, scale 1 or artifact scales
 *   q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl          llama.cpp's KV block formats
 *   hh<b>[-i8][-<f>%][-w<W>][-g<G>]               heavy-hitter mixed precision (kernels/schemes/hh.c)
 * Modifiers:
 *   +sink<N>                  first N tokens of every window exact (KVQuant §3.5);
 *                             default 0, or the artifact's n_sink for schemes
 *                             that read an artifact
 *   +pre-rope, +post-rope     which keys the scheme quantizes (overrides the
 *                             family default; artifact schemes must match the
 *                             artifact's key_position)
 *   +intactkv                 a full-precision prefix (IntactKV) from an
 *                             artifact is attended before every window (never
 *                             quantized, never scored; window positions start
 *                             at P); error if no artifact holds one
 *   +artifact<N>              take tables / prefix from the N-th --artifact (1-based)
 *                             instead of the first matching one
 *   +hadamard                 rotate every cached key / value head vector by
 *                             llama.cpp's orthonormal Walsh-Hadamard blocks
 *                             (kernels/quant/hadamard.h) before the family
 *                             quantizes it and back after: the cache holds
 *                             Q(x·H), attention reads Q(x·H)·Hᵀ. Any family;
 *                             keys at the family's stage (pre-RoPE for nuq,
 *                             int-pc). No stored bits. Artifact schemes need an
 *                             artifact fitted on the same rotation (kvcalib
 *                             --rotate hadamard)
 *   +rht[<seed>]              the same after random ±1 signs per channel
 *                             (QuaRot's randomised Hadamard), seed default 0
 * Unknown names → KVQ_EINVAL listing the valid forms (kvq_scheme_syntax).
 *
 * One implementation. A bound scheme carries a kvq_kv_desc (family.h: the
 * family and its parameters, the artifact's tables); its transform IS the
 * family's (kv_desc.h), on the CPU through the hook below, on the GPU
 * natively when the family has a CUDA part (kvq_eval_scheme_kv_desc) and on
 * the host between layers otherwise.
 *
 * Decode equivalence: every transform is, per query, a function of the tokens
 * up to that query and of decisions taken at earlier steps (family.h, "the
 * cache-simulation contract"), so the batched window equals token-by-token
 * decoding with a real quantized cache (tests/test_kveval.c).
 */
#ifndef KVQ_SCHEME_H
#define KVQ_SCHEME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "artifact.h"
#include "family.h"
#include "forward.h"
#include "kv_desc.h"
#include "model.h"
#include "quant.h"
#include "status.h"

#define KVQ_SPEC_MAX 128

/* A parsed spec, not yet bound to artifacts. */
typedef struct {
    char spec[KVQ_SPEC_MAX];       /* the string as given */
    kvq_scheme q;                  /* family (q.fam) and parameters */
    kvq_key_stage key_stage;       /* resolved: the family default or the modifier */
    bool stage_set;                /* +pre-rope / +post-rope given */
    bool sink_set;                 /* +sink<N> given */
    bool intactkv;                 /* +intactkv */
    kvq_rotation rot;              /* +hadamard / +rht[<seed>]; zero = none */
    int artifact_index;            /* +artifact<N>: 1-based index into the artifact set, 0 = auto */
} kvq_scheme_spec;

/* Parse a spec (grammar above). Errors (KVQ_EINVAL) quote the spec and name
 * the offending part; an unknown base lists the valid forms. */
kvq_status kvq_scheme_parse(const char *spec, kvq_scheme_spec *out, kvq_err *err);

/* One line listing the valid forms (for --help and errors), built from the
 * registry (family.h): the families' syntax, then the modifiers; into buf
 * (KVQ_SCHEME_SYNTAX_MAX bytes hold it), which is returned. */
#define KVQ_SCHEME_SYNTAX_MAX 2048
const char *kvq_scheme_syntax(char *buf, size_t n);

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
    kvq_kv_desc desc;              /* the transform as data (family and parameters, key stage, the
                                    * artifact set's tables), validated at bind */
} kvq_eval_scheme;

/* Bind a parsed spec: choose the artifact (the +artifact<N> one, else the
 * first whose parameters match), take its n_sink unless +sink was given,
 * check sizes against the model, and build and validate the descriptor
 * (kvq_kv_desc_validate). Errors: a scheme that needs an
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

/* The scheme's descriptor (what kvq_engine_set_kv runs: on the CPU any
 * family; on the GPU natively when the family has a CUDA part, family.h
 * `cuda`, else the caller runs the hook, kvq_scheme_hooks, on the host);
 * NULL when there is no transform (fp32). Points into s. */
const kvq_kv_desc *kvq_eval_scheme_kv_desc(const kvq_eval_scheme *s);

/* What a GPU engine is given (kvq_engine_set_kv): the descriptor when the
 * family has a native CUDA part, else NULL, and the caller runs the scheme's
 * hooks (kvq_scheme_hooks) on the host between GPU layers (fp8, the llama.cpp
 * block formats, hh). Every GPU path of kveval chooses through this. */
const kvq_kv_desc *kvq_eval_scheme_gpu_desc(const kvq_eval_scheme *s);

/* Code bits of K and V for the table: 32 / 16 for fp32 / fp16. */
int kvq_eval_scheme_code_bits(const kvq_eval_scheme *s, char kv);

/* Effective bits per element of K and V in a cache holding ctx window
 * tokens (the family's accounting, kvq_scheme_bits_ex: KVQuant App.M
 * conventions — fp16 scales and zero points, outliers as 16-bit value +
 * 16-bit index + 32-bit row pointer per token, sink and KIVI residual tokens
 * at 16 bits), plus the +intactkv prefix (P tokens at 16 bits; 32 for fp32),
 * averaged over ctx + P tokens. Nominal: from the parameters alone. */
kvq_status kvq_eval_scheme_bits(const kvq_eval_scheme *s, size_t ctx, const kvq_hparams *hp, kvq_bits *out,
                                kvq_err *err);

/* kvq_eval_scheme_bits from the counts a run realised (the key outlier
 * fraction of nuq / int-pc, the high-precision share of heavy-hitter schemes)
 * instead of the nominal parameters; k / v may be NULL (nominal). */
kvq_status kvq_eval_scheme_bits_run(const kvq_eval_scheme *s, size_t ctx, const kvq_hparams *hp, const kvq_quant_counts *k,
                                    const kvq_quant_counts *v, kvq_bits *out, kvq_err *err);

/* KV cache size in MiB (2^20 bytes) of one sequence of ctx window tokens
 * (+ prefix): n_layers * (ctx + P) * kv_dim * (bits.k + bits.v) / 8 / 2^20. */
double kvq_eval_scheme_cache_mib(const kvq_eval_scheme *s, const kvq_bits *bits, size_t ctx, const kvq_hparams *hp);

/* ---- the transform hook --------------------------------------------------- */

/* Per-run state of a scheme's hook (counters accumulate over layers/windows;
 * `state` is the family's, allocated on first use: free with
 * kvq_scheme_run_free). */
typedef struct {
    const kvq_eval_scheme *s;
    kvq_quant_counts k_counts, v_counts;
    double seconds;  /* wall time spent inside the transform (quantization simulation) */
    void *state;     /* the family's run state (kvq_kv_desc_run.state), NULL until used */
} kvq_scheme_run;

/* Fill hooks for the forward: transform = the scheme's (none for the
 * identity), key_stage as the scheme says, user = run (which must outlive the
 * forward calls). Resets run. */
void kvq_scheme_hooks(kvq_scheme_run *run, const kvq_eval_scheme *s, kvq_hooks *hooks);
/* Free the family's run state (safe on a run that never transformed). */
void kvq_scheme_run_free(kvq_scheme_run *run);

/* The transform callback itself (kvq_hooks.transform signature; user is a
 * kvq_scheme_run): kvq_kv_desc_transform on the scheme's descriptor, counters
 * into run, timed into run->seconds. Exposed for tests. */
kvq_status kvq_scheme_transform(void *user, const kvq_layer_ctx *ctx, float *k, float *v, kvq_kv_alt *alt,
                                kvq_err *err);

#endif
