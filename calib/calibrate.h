/* calibrate.h — kvcalib's library entry point: read a kvdump HDF5 file
 * (formats/DUMP.md) layer by layer, build the tables of one scheme with
 * kernels/quant/tables.h, fill the bits accounting and fingerprints, and write the
 * calibration artifact (kernels/schemes/ARTIFACT.md).
 *
 * What is read, per layer i, as float32 [N*L][kv_dim] (samples concatenated,
 * kv_dim = n_kv_heads*head_dim, channel c = h*head_dim + d, exactly the
 * dump's [N][L][n_kv_heads][head_dim] row-major layout):
 *   nuq     keys: /layers/i/k_pre_rope (or /layers/i/k with post_rope)
 *           values: /layers/i/v
 *           weights (fisher): /layers/i/fisher_k_pre_rope, /layers/i/fisher_v
 *   int-pc  keys only (thresholds), no weights
 *   fp8     keys /layers/i/k (post-RoPE, what an engine caches; k_pre_rope
 *           with --keys pre-rope) and values /layers/i/v, no weights:
 *           scale = absmax (or the percentile) of |x| / fmt_max per layer,
 *           per tensor or per KV head (kvq_fp8_calib_tensor / _heads of
 *           kernels/quant/quant_fp8.h over the rows left after dropping each
 *           sample's first n_sink tokens)
 *   int, kivi  nothing (no fitted tables; the artifact is metadata only)
 * One work item is one (layer, K|V) tensor with its weights: at most
 * 2 * N*L*kv_dim floats live per worker (default model, 16 x 2048: 50 MB),
 * never the whole dump. Work items run on OpenMP threads (n_threads); HDF5
 * reads are serialised in a named critical section (serial HDF5), fitting
 * runs in parallel. Results do not depend on the thread count or schedule
 * (byte-identical artifacts).
 *
 * Fisher weights for post-RoPE keys (the --keys post-rope ablation): the
 * dump only has (dL/dk_pre_rope)^2. RoPE rotates each pair (2j, 2j+1) by a
 * position-dependent angle, which preserves the pair's squared-gradient sum
 * but not its split, so both channels of a rotary pair get the pair mean
 * (f[2j] + f[2j+1]) / 2 (the expectation of the rotated split over a
 * uniform angle); channels >= rope_dim keep their own weight.
 *
 * Rotated fits (kvcalib --rotate hadamard|rht[<seed>]): every (layer, K|V)
 * tensor is rotated as the +hadamard / +rht modifier rotates the cache
 * (kvq_rotation_apply: keys at the stage the method quantizes, so pre-RoPE
 * for nuq), then fitted; the artifact records kvq.rotation and binds only to
 * a spec with the same modifier. Fisher weights are squared gradients and do
 * not rotate: the weight of a rotated channel is the mean squared gradient
 * of its Hadamard block, i.e. E[(g·D·H)_j^2] over random signs D (exact in
 * expectation for +rht, the cross terms dropped for +hadamard), in the
 * spirit of the RoPE pair mean above.
 *
 * Errors (all name the dump file; nothing is written on error):
 *   KVQ_EINVAL  bad option (field named: "bits: expected 1..8, found 9",
 *               "outlier fraction: ...", "method: ..."), an incomplete dump
 *               (samples_done < n_samples), a partial layer range for a
 *               method that needs every layer, missing fisher_* datasets
 *               ("layer 0: dataset fisher_k_pre_rope is missing ... rerun
 *               kvdump with --fisher, or calibrate with --no-fisher");
 *   KVQ_ENUMERIC NaN/Inf in a dataset (layer, sample, position, head,
 *               channel named), or negative / non-finite Fisher weights;
 *   KVQ_EIO / KVQ_EFORMAT / KVQ_EUNSUPPORTED from the dump reader (e.g. a
 *               dump of another schema version) and the artifact writer.
 */
#ifndef KVQ_CALIBRATE_H
#define KVQ_CALIBRATE_H

#include <stdbool.h>
#include <stddef.h>

#include "artifact.h"
#include "dump.h"
#include "family.h"
#include "kmeans.h"
#include "status.h"
#include "vllm_scales.h"

/* Called once per finished (layer, K|V) table, serialised (never concurrently),
 * in completion order (not necessarily layer order): done = tables finished
 * so far including this one, of total. kv is 'k' or 'v'; seconds = wall time
 * of that item (read + fit). */
typedef void (*kvq_calib_table_fn)(void *ctx, int done, int total, int layer, char kv, const kvq_kv_table *t,
                                   double seconds);

typedef struct {
    const kvq_family *method; /* a family with a calib part (family.h; kvq_family_method("nuq"), ...) */
    int k_bits, v_bits;       /* 1..8 */
    double outlier_frac;      /* [0, 0.5): nuq and int-pc; must be 0 for int and kivi */
    size_t n_sink;            /* first tokens of every sample excluded from calibration, kept exact at run time */
    bool post_rope;           /* fit keys after RoPE (/layers/i/k); default pre-RoPE (k_pre_rope) */
    bool fisher;              /* nuq: weight the datatype fit by the dump's Fisher information */
    bool per_head;            /* nuq: one datatype per KV head; fp8: one scale per KV head */
    bool fp8_e5m2;            /* fp8: scales for E5M2 (max 57344) instead of E4M3FN (max 448) */
    double fp8_percentile;    /* fp8: 100 = absmax, (0, 100) = that percentile of |x|; 0 for other methods */
    kvq_kmeans_opts fit;      /* nuq: auto (better of Lloyd / exact) by default */
    size_t group_size;        /* int / int-pc: channels per token group (0 = whole token); kivi: G */
    size_t residual_length;   /* kivi: R */
    size_t bits_ctx;          /* context length of the bits accounting; 0 = the dump's seq_len */
    double x[KVQ_ARTIFACT_X]; /* the family's own parameters (family.h artifact->params names them; defaults
                                 calib->x; kvcalib --param NAME=VALUE), stored in the artifact as p.x */
    int n_threads;            /* 0 = OpenMP default (capped at the number of work items) */
    kvq_rotation rotation;    /* fit on rotated K / V (hadamard.h; kvcalib --rotate): the rotation a scheme applies
                                 with +hadamard / +rht, recorded as kvq.rotation; methods with fitted tables only */
    kvq_calib_table_fn on_table; /* optional progress hook */
    void *on_table_ctx;
} kvq_calibrate_opts;

/* Defaults per method (the family's calib part, the papers' settings):
 *   nuq:    4 bit, outliers 0.01, sink 1, pre-RoPE keys, Fisher, per-layer, fit auto
 *   int:    4 bit, whole-token groups (group 0), sink 1, post-RoPE keys, no outliers
 *           (KVQuant's baselines: post-RoPE per-token keys, App.P; 1 fp16 sink token, Table 18)
 *   int-pc: 4 bit, outliers 0, sink 1, post-RoPE keys (the "per-channel keys" step of
 *           KVQuant's ablation, before pre-RoPE; --keys pre-rope for the next step)
 *   kivi:   2 bit, G = 32, R = 128, no sink, post-RoPE keys (what KIVI's cache holds;
 *           KIVI-2 of the notes)
 *   fp8:    8 bit E4M3FN, per-tensor absmax scales (percentile 100), no sink,
 *           post-RoPE keys (vLLM's cache with llm-compressor's amax / 448) */
kvq_calibrate_opts kvq_calibrate_defaults(const kvq_family *m);

/* Check options that do not depend on the dump; errors name the field. */
kvq_status kvq_calibrate_validate(const kvq_calibrate_opts *o, kvq_err *err);

/* Build the artifact for the dump open in r (dump_name is used in messages).
 * *out is filled (tables owned; kvq_artifact_free); on error it is empty.
 * The artifact's model fingerprint is kvq_identity_model_from_dump, its dump
 * fingerprint kvq_identity_dump (formats/identity.h). */
kvq_status kvq_calibrate_dump(kvq_dump_reader *r, const char *dump_name, const kvq_calibrate_opts *o,
                              kvq_artifact *out, kvq_err *err);

/* Open dump_path, calibrate, and write out_path; if result is non-NULL it
 * receives the artifact written (caller frees with kvq_artifact_free; empty
 * on error). Refuses (KVQ_EIO, before any work) when out_path exists and
 * !force. The artifact is written to
 * "<out_path>.tmp" (the writer's own .partial + rename) and then moved to
 * out_path with link() (no-replace: a file that appeared meanwhile is not
 * overwritten) or, with force, rename(). On any error out_path is untouched
 * and no temporary file is left. */
kvq_status kvq_calibrate_file(const char *dump_path, const char *out_path, bool force, const kvq_calibrate_opts *o,
                              kvq_artifact *result, kvq_err *err);

/* Export an fp8 artifact's scales for vLLM (formats/vllm_scales.h): per
 * layer i, model.layers.<i>.self_attn.k_scale / v_scale float32, shape []
 * (per-tensor artifact) or [n_kv_heads] (per-head), values = the artifact's
 * layers.<i>.k.fp8_scale / v.fp8_scale unchanged. Metadata records the
 * source (kvq.fp8_format, kvq.fp8_percentile, kvq.granularity,
 * kvq.model_fingerprint, kvq.dump_fingerprint, kvq.n_sink). Refuses
 * (nothing written) when out_path exists and !force (KVQ_EIO), when the
 * artifact is not method fp8 (KVQ_EINVAL naming the method), was fitted on
 * pre-RoPE keys (KVQ_EINVAL: vLLM caches post-RoPE keys), or holds E5M2
 * scales (KVQ_EUNSUPPORTED: vLLM's fp8_e5m2 cache is used without
 * checkpoint scales). Written atomically. */
kvq_status kvq_calibrate_export_vllm(const kvq_artifact *a, const char *out_path, bool force, kvq_err *err);

/* The same in a chosen form (formats/vllm_scales.h): vllm (as above),
 * compressed-tensors (llm-compressor's shapes [1] / [n_kv_heads, 1, 1]; with
 * config_path also the config.json fragment with quantization_config.
 * kv_cache_scheme, strategy tensor or attn_head) or modelopt
 * (self_attn.k_proj.k_scale / v_proj.v_scale, shape [1]; a per-head artifact
 * is refused with KVQ_EUNSUPPORTED). config_path with another form:
 * KVQ_EINVAL. An existing config_path is refused without force (KVQ_EIO),
 * before anything is written. */
kvq_status kvq_calibrate_export_scales(const kvq_artifact *a, kvq_kv_scale_form form, const char *out_path,
                                       const char *config_path, bool force, kvq_err *err);

#endif
