/* artifact.h — the calibration artifact: one safetensors file holding the
 * tables a quantized KV cache needs (nuqX levels, per-channel key
 * thresholds) plus every parameter of the scheme, its bits accounting and
 * the fingerprints of the model and dump it was fitted on. Schema:
 * kernels/schemes/ARTIFACT.md (versioned; this build writes and reads version
 * KVQ_ARTIFACT_VERSION and rejects newer ones).
 *
 * One loader serves every family with an artifact part (family.h): nuqX
 * (KVQuant), intX per-token, intX with per-channel keys, KIVI (no tables;
 * bits, group size, residual length and axes only), FP8 caches with
 * calibrated scales. Which tables a method stores, its parameter rules and
 * its --inspect lines are the family's (kernels/schemes/<family>.c).
 *
 * Layout of the tables, per layer i (kv_dim = n_kv_heads * head_dim):
 *   k.levels         float32 [2^k_bits] (per-layer) or [n_kv_heads][2^k_bits]
 *                    (per-head), ascending, in [-1, 1]               (nuq)
 *   k.channel_lower  float32 [kv_dim], k.channel_upper float32 [kv_dim]
 *                    raw (un-normalised) pre- or post-RoPE key units  (nuq, int-pc)
 *   v.levels         as k.levels with v_bits                          (nuq)
 *   k.fp8_scale, v.fp8_scale  float32 [1] (per tensor) or [n_kv_heads]
 *                    (per KV head): vLLM's k_scale / v_scale, stored =
 *                    fp8(x / scale) (kernels/quant/quant_fp8.h)                (fp8)
 *   fit reports and calibration counts (see kvq_kv_table).
 */
#ifndef KVQ_ARTIFACT_H
#define KVQ_ARTIFACT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "hadamard.h"
#include "status.h"

#define KVQ_ARTIFACT_SCHEMA "kvq-calib-artifact"
#define KVQ_ARTIFACT_VERSION 1
#define KVQ_FINGERPRINT_MAX 256
#define KVQ_ARTIFACT_X 4 /* family parameters in an artifact (= KVQ_SCHEME_X, family.h) */

/* The method is a family of the scheme registry (family.h; one with an
 * artifact part): its name is kvq.method, and the family says which tables
 * the artifact holds, how its parameters are checked and what --inspect
 * prints. */
struct kvq_family;

/* Fit choice codes stored per table. */
enum { KVQ_FIT_CHOSEN_NONE = 0, KVQ_FIT_CHOSEN_LLOYD = 1, KVQ_FIT_CHOSEN_EXACT = 2 };

/* A family's own table of one (layer, K|V): float32, 1 to 3 dimensions,
 * row-major, stored as tensor layers.<i>.<k|v>.<name> (ARTIFACT.md "Family
 * tables"). Which names a family stores is its artifact part's `tensors`
 * list (family.h); shapes and values are checked by its `check_tensors`.
 * Examples: channel smoothing scales [kv_dim], a codebook
 * [n_groups][n_codes][group_dim], a projection [n_kv_heads][rank][head_dim]. */
#define KVQ_FAM_TENSORS 6      /* family tables per (layer, K|V) */
#define KVQ_FAM_TENSOR_DIMS 3
typedef struct {
    char name[32];             /* the family's name (letters, digits, '_') */
    uint32_t n_dims;           /* 1..KVQ_FAM_TENSOR_DIMS */
    uint64_t shape[KVQ_FAM_TENSOR_DIMS];
    float *data;               /* owned, prod(shape) floats */
} kvq_fam_tensor;

/* Tables for one (layer, K|V). Arrays owned (malloc) unless NULL. */
typedef struct {
    int bits;               /* code bits of this tensor */
    size_t n_tables;        /* datatypes: 1 per-layer, n_kv_heads per-head, 0 none */
    size_t kv_dim;
    float *levels;          /* [n_tables][1 << bits] or NULL */
    float *channel_lower;   /* [kv_dim] or NULL (keys of nuq / int-pc only) */
    float *channel_upper;   /* [kv_dim] or NULL */
    double *obj_lloyd;      /* [n_tables] weighted SSE of Lloyd's levels on the calibration points, -1 = not run */
    double *obj_exact;      /* [n_tables] same for the exact 1-D optimum */
    uint8_t *chosen;        /* [n_tables] KVQ_FIT_CHOSEN_* */
    float *fp8_scale;       /* [n_fp8_scales] (fp8 only) or NULL */
    size_t n_fp8_scales;    /* fp8: 1 per tensor, n_kv_heads per head; 0 otherwise */
    uint64_t n_elems;       /* calibration elements considered (sink tokens excluded) */
    uint64_t n_outliers;    /* of those, outside the thresholds (realised outlier fraction);
                               fp8: |x| / scale clipped by saturation (>= 464 E4M3FN, 61440 E5M2) */
    uint64_t n_points;      /* points fitted (inliers with non-zero range and weight) */
    kvq_fam_tensor ft[KVQ_FAM_TENSORS]; /* the family's own tables (family.h artifact->tensors) */
    size_t n_ft;
} kvq_kv_table;

void kvq_kv_table_free(kvq_kv_table *t);

/* Add a family table `name` of shape[n_dims] (zero-filled) to t; *data receives its storage.
 * Errors: KVQ_EINVAL (name empty, too long, not [A-Za-z0-9_], already present, n_dims out of
 * 1..3, a zero or too large extent, more than KVQ_FAM_TENSORS), KVQ_ENOMEM. */
kvq_status kvq_kv_table_add(kvq_kv_table *t, const char *name, uint32_t n_dims, const uint64_t *shape, float **data,
                            kvq_err *err);
/* The family table `name` of t, or NULL. */
const kvq_fam_tensor *kvq_kv_table_get(const kvq_kv_table *t, const char *name);
/* Number of floats of a family table (product of its shape). */
size_t kvq_fam_tensor_len(const kvq_fam_tensor *x);

typedef struct kvq_artifact_params {
    const struct kvq_family *method; /* the family ("nuq", "int", "int-pc", "kivi", "fp8", ...) */
    int k_bits, v_bits;        /* 1..8 */
    double outlier_frac;       /* [0, 0.5): total, both tails (nuq, int-pc) */
    size_t n_sink;             /* first n tokens of each sequence at full precision */
    bool post_rope;            /* keys taken after RoPE (ablation); default pre-RoPE */
    bool per_head;             /* per-head datatypes (nuq); per-KV-head scales (fp8) */
    size_t group_size;         /* int: channels per token group (0 = whole token); kivi: G */
    size_t residual_length;    /* kivi: R (multiple of G) */
    bool fisher;               /* levels fitted with Fisher weights */
    bool fp8_e5m2;             /* fp8: E5M2 (max 57344) instead of E4M3FN (max 448) */
    double fp8_percentile;     /* fp8: statistic of |x| mapped to the format's max: 100 = absmax, else (0, 100) */
    char fit[16];              /* "auto" | "lloyd" | "exact" | "" (no fitted tables) */
    size_t n_layers, n_kv_heads, head_dim;
    double bits_k, bits_v;     /* effective bits per element (kvq_scheme_bits) */
    size_t bits_ctx;           /* context length the accounting assumes */
    char model_fingerprint[KVQ_FINGERPRINT_MAX]; /* sha256 of weights + hyperparameters + RoPE params */
    char dump_fingerprint[KVQ_FINGERPRINT_MAX];  /* the dump's fingerprint */
    char model_rope[512];      /* the RoPE configuration calibrated under (identity.h kvq_identity_rope_desc),
                                  metadata kvq.model_rope; "" in artifacts written before it was recorded */
    double x[KVQ_ARTIFACT_X];  /* the family's own parameters, named by its artifact part's `params`
                                  (metadata kvq.<method>.<name>); unnamed entries are 0 */
    kvq_rotation rotation;     /* the tables were fitted on rotated K / V (kvcalib --rotate; hadamard.h): metadata
                                  kvq.rotation "hadamard" | "rht" (+ kvq.rotation_seed), absent = none; a spec binds
                                  it only with the same +hadamard / +rht modifier */
} kvq_artifact_params;

/* Training summary of an IntactKV prefix (kvcalib intactkv --train; all
 * zero / empty for an untrained prefix). */
typedef struct {
    char scheme[160];          /* the base scheme the window tokens were quantized with (kveval spec) */
    size_t steps, accum;       /* optimizer steps, samples per step (gradient accumulation) */
    size_t samples, seq_len;   /* calibration windows and their length in tokens */
    double lr, beta1, beta2, eps, clip; /* Adam and global gradient-norm clipping */
    uint64_t seed;             /* window sampling and epoch shuffling */
    double loss_before, loss_after; /* mean loss over all calibration windows before / after training */
    double seconds;            /* wall time of the training (targets + steps + final loss) */
    char text_sha256[65];      /* sha256 of the calibration text file */
} kvq_prefix_training;

/* An IntactKV prefix (Liu et al. 2024, IntactKV; notes
 * ../shared/docs/kivi-intactkv-mikv.md §2): the K/V of the first P tokens as
 * the full-precision model computes them (or as calibrated by training),
 * attended by every window token, never quantized. Arrays owned (malloc).
 * Tensors (ARTIFACT.md "IntactKV prefix"), kv_dim = n_kv_heads*head_dim:
 *   intactkv.token_ids      I32 [P]
 *   intactkv.positions      I32 [P]   = 0..P-1 (the prefix always starts the sequence)
 *   layers.<i>.intactkv.k        F32 [P, kv_dim]  post-RoPE keys (what attention reads)
 *   layers.<i>.intactkv.k_pre_rope F32 [P, kv_dim] pre-RoPE keys (= RoPE^-1 of k at positions)
 *   layers.<i>.intactkv.v        F32 [P, kv_dim]  values
 *   intactkv.loss_curve     F64 [n_loss] (trained only) mean training loss of each step */
typedef struct {
    size_t P;                  /* >= 1 */
    int32_t *token_ids;        /* [P] */
    int32_t *positions;        /* [P] */
    float *k, *k_pre, *v;      /* [n_layers][P][kv_dim] each, row-major */
    char *text;                /* the prefix as given: "bos" or the text (NUL-terminated, owned) */
    bool special;              /* the text was tokenised with special tokens recognised */
    bool trained;
    kvq_prefix_training train; /* trained only */
    double *loss_curve;        /* [n_loss] (trained only, else NULL) */
    size_t n_loss;
} kvq_artifact_prefix;

void kvq_artifact_prefix_free(kvq_artifact_prefix *px);
/* Allocate a prefix of P entries for n_layers x kv_dim: token_ids, positions
 * [P] and k, k_pre, v [n_layers][P][kv_dim] (uninitialised); sets px->P.
 * Errors: KVQ_ENOMEM (what names the caller, e.g. "intactkv"), on which the
 * caller frees px with kvq_artifact_prefix_free. */
kvq_status kvq_artifact_prefix_alloc(kvq_artifact_prefix *px, size_t P, size_t n_layers, size_t kv_dim, const char *what,
                                     kvq_err *err);

typedef struct kvq_artifact {
    kvq_artifact_params p;
    kvq_kv_table *k, *v;       /* [n_layers] each; NULL for int and kivi */
    kvq_artifact_prefix *prefix; /* IntactKV prefix, or NULL (owned; freed by kvq_artifact_free) */
} kvq_artifact;

/* A nuq datatype must span at least this much of [-1, 1] (first to last level). */
#define KVQ_ARTIFACT_MIN_LEVEL_SPAN 1e-3

/* Check parameters and, when present, table shapes and values (levels
 * ascending in [-1, 1] and finite; thresholds finite, lower <= upper; fp8
 * scales finite and > 0). Degenerate tables are refused too: a nuq datatype
 * whose levels span less than KVQ_ARTIFACT_MIN_LEVEL_SPAN (all equal: one
 * value), per-channel thresholds with lower == upper in every channel.
 * Errors name the field: "k_bits: expected 1..8, found 9",
 * "outlier_fraction: expected [0, 0.5), found 0.5",
 * "layers.3.k.channel_lower[17]: not finite". */
kvq_status kvq_artifact_validate(const kvq_artifact *a, kvq_err *err);

/* Validate, then write. Same artifact → byte-identical file (metadata
 * numbers printed with %.17g, deterministic safetensors layout). */
kvq_status kvq_artifact_write(const char *path, const kvq_artifact *a, kvq_err *err);

/* kvq_artifact_write for a user-named output: refuses an existing `path`
 * unless force (KVQ_EIO "... already exists ... use --force"), writes
 * `path`.tmp, then moves it into place — without force by a no-replace
 * rename (renameat2 RENAME_NOREPLACE, or link() where the file system lacks
 * it), so a file that appears at `path` meanwhile is never overwritten. */
kvq_status kvq_artifact_write_new(const char *path, const kvq_artifact *a, bool force, kvq_err *err);

/* With a prefix, validation also checks: P >= 1, token ids >= 0, positions
 * 0..P-1, k / k_pre / v present and finite ("intactkv: layers.3.k[17]: not
 * finite"), text present, a trained prefix with n_loss >= 1 finite losses.
 * Readers take the prefix when intactkv.token_ids is present (the other
 * tensors are then required); files without it have prefix == NULL. */

/* Read and validate. Unknown schema → KVQ_EFORMAT; newer schema version →
 * KVQ_EUNSUPPORTED; missing or malformed fields → KVQ_EFORMAT naming them.
 * Free with kvq_artifact_free. */
kvq_status kvq_artifact_read(const char *path, kvq_artifact *a, kvq_err *err);
void kvq_artifact_free(kvq_artifact *a);

/* Fill p->bits_k / bits_v / bits_ctx from the artifact parameters with the
 * family's accounting (kvq_scheme_bits_ex, nominal) at context length ctx. */
kvq_status kvq_calib_fill_bits(kvq_artifact_params *p, size_t ctx, kvq_err *err);

/* The artifact's own scheme as a kveval spec ("nuq3-1%", "kivi2-g32-r128",
 * "fp8-tensor"; the family's canonical name). Returns buf. */
const char *kvq_artifact_scheme_spec(const kvq_artifact_params *p, char *buf, size_t n);

/* Print a readable summary of the artifact at path to f (kvcalib --inspect). */
kvq_status kvq_artifact_inspect(FILE *f, const char *path, kvq_err *err);

/* Compare the artifact's model fingerprint with the loading model's.
 * Equal → KVQ_OK. Different (or either empty) → KVQ_EMISMATCH naming both,
 * unless allow_mismatch, in which case a "warning: ..." line goes to warn
 * (if non-NULL) and KVQ_OK is returned. */
/* As kvq_artifact_check_model, with the model's RoPE configuration
 * (kvq_identity_rope_desc_hp; NULL: unknown): when it differs from the
 * artifact's kvq.model_rope, the mismatch message names both ("calibrated
 * under RoPE A, the model uses RoPE B"). */
kvq_status kvq_artifact_check_model_rope(const kvq_artifact_params *p, const char *model_fingerprint, const char *model_rope,
                                         bool allow_mismatch, FILE *warn, kvq_err *err);
kvq_status kvq_artifact_check_model(const kvq_artifact_params *p, const char *model_fingerprint,
                                    bool allow_mismatch, FILE *warn, kvq_err *err);

#endif
