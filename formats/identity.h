/* identity.h — the fingerprints a calibration artifact records (kernels/schemes/ARTIFACT.md,
 * "Fingerprints"): which model and which dump the tables were fitted on.
 *
 * Artifact model fingerprint. A dump does not record every hyperparameter
 * kvq_model_fingerprint (model.h) hashes (no norm_eps, no tied flag), so
 * kvcalib cannot recompute that one from a dump. The artifact therefore
 * uses its own fingerprint, built from exactly what DUMP.md root attributes
 * record, which kveval recomputes from the model file with
 * kvq_identity_model: SHA-256 (64 lowercase hex digits + NUL) of the text
 *   "kvq-artifact-model-v1\n"
 *   "weights_sha256=<model_sha256>\nmodel_arch=<model_arch>\n"
 *   "n_layers=%d\ndim=%d\nhidden_dim=%d\nn_heads=%d\nn_kv_heads=%d\n"
 *   "head_dim=%d\nvocab_size=%d\nctx_len=%d\n"
 *   "rope_theta=%a\nrope_dim=%d\nrope_pairing=<s>\nrope_scaling=<s>\n"
 *   "rope_scale_factor=%a\nrope_low_freq_factor=%a\nrope_high_freq_factor=%a\n"
 *   "rope_orig_ctx=%d\n"
 *   ["rope_params=<s>\n"]  (only when the dump's rope_params is not empty: yarn, freq_factors)
 *   ["attention=<s>\n"]    (only when not empty: a sliding window)
 * with the values of the dump's root attributes of the same names (floats
 * as C99 hex-float of the float64 attribute). From a model, the fields are
 * those kvq_dump_meta_set_hparams writes (so kvdump → kvcalib and kveval
 * agree by construction), model_arch included, and weights_sha256 =
 * kvq_sha256_path(model path) — which is what kvdump must store as the
 * dump's model_sha256.
 *
 * Dump fingerprint: SHA-256 of
 *   "kvq-dump-v1\n" + one "<attribute>=<value>\n" line per root attribute of
 *   DUMP.md except model_path, corpus_path and command_line (locations and
 *   provenance, not content), in DUMP.md order, floats as %a, int64 as %lld,
 *   then "samples_done=%lld\n", "sample_offsets=" + the offsets comma-separated
 *   + "\n", then the bytes of /tokens (int32 little-endian, [samples_done][L]).
 * It identifies the dump's inputs and sampling (model, tokenizer, corpus,
 * windows, dtype, content flags, writer version) without reading the
 * activation tensors (hashing 2.4 GB would cost more than calibrating);
 * dumps that differ only in tensor bytes written by the same kvq version from
 * the same inputs are, by kvdump's determinism, identical.
 */
#ifndef KVQ_IDENTITY_H
#define KVQ_IDENTITY_H

#include "dump.h"
#include "model.h"
#include "status.h"

/* Artifact model fingerprint from a dump's root attributes (meta). KVQ_EINVAL
 * if model_sha256 is not 64 hex digits. */
kvq_status kvq_identity_model_from_dump(const kvq_dump_meta *m, char hex[65], kvq_err *err);

/* The same fingerprint from a loaded model: hashes the weights file at
 * model->path (kvq_sha256_path; KVQ_EIO naming the file). */
kvq_status kvq_identity_model(const kvq_model *model, char hex[65], kvq_err *err);

/* The same from a weights digest and hyperparameters (no file access). */
kvq_status kvq_identity_model_hp(const char *weights_sha256, const kvq_hparams *hp, char hex[65], kvq_err *err);

/* Human-readable RoPE configuration from a dump's root attributes, e.g.
 * "llama3 (theta 500000, rope_dim 128, factor 8, low_freq_factor 1,
 * high_freq_factor 4, original ctx 8192)"; artifacts record it as
 * kvq.model_rope, and a fingerprint mismatch names both configurations. */
void kvq_identity_rope_desc(const kvq_dump_meta *m, char *buf, size_t n);
/* The same for a loaded model's hyperparameters. */
kvq_status kvq_identity_rope_desc_hp(const kvq_hparams *hp, char *buf, size_t n, kvq_err *err);

/* Dump fingerprint (reads the root attributes already in r and /tokens). */
kvq_status kvq_identity_dump(kvq_dump_reader *r, char hex[65], kvq_err *err);

#endif
