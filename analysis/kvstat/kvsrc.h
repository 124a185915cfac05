/* kvsrc.h — kvstat's sources and schemes over the other modules:
 *  - a kvq_kvsrc over a kvdump HDF5 file (formats/dump.h, schema DUMP.md);
 *  - quantize→dequantize schemes (kvq_qscheme) built from a calibration
 *    artifact (kernels/schemes/artifact.h, ARTIFACT.md) or from plain parameters
 *    (uniform per-token intX, KIVI), applied with kernels/quant/quant.h.
 */
#ifndef KVQ_KVSRC_H
#define KVQ_KVSRC_H

#include "artifact.h"
#include "dump.h"
#include "kv_desc.h"
#include "kvstats.h"
#include "quant.h"
#include "scheme.h"

/* Open a dump read-only and fill src over it (src->ctx = the reader; close
 * with kvq_kvsrc_dump_close). n_samples = samples committed (a .partial dump
 * is analysed up to its last committed sample). src->model = basename of the
 * dump's model_path. Errors: those of kvq_dump_open (KVQ_EUNSUPPORTED for
 * another schema version, KVQ_EFORMAT for a file that is not a kvq dump),
 * KVQ_EFORMAT if no sample is committed yet. */
kvq_status kvq_kvsrc_dump_open(const char *path, kvq_kvsrc *src, kvq_err *err);
void kvq_kvsrc_dump_close(kvq_kvsrc *src);
/* The dump's root attributes (NULL unless src came from kvq_kvsrc_dump_open). */
const kvq_dump_meta *kvq_kvsrc_dump_meta(const kvq_kvsrc *src);

/* Check that an artifact belongs to the model of a source: n_layers,
 * n_kv_heads and head_dim must be equal (KVQ_EMISMATCH naming the field and
 * both values, "artifact for another model?"). */
kvq_status kvq_artifact_check_source(const kvq_artifact *a, const kvq_kvsrc *src, kvq_err *err);

/* State of one scheme (the kvq_qscheme's ctx points here; keep it alive). */
typedef struct {
    kvq_kv_desc desc;               /* family, parameters, tables */
    kvq_kv_layer_tables *tables;    /* owned views of the artifact's tables, or NULL */
    size_t head_dim;
    char name[128];
    double *calib_k, *calib_v;      /* [n_layers] calibrated outlier fraction, or NULL */
} kvq_qscheme_state;

/* The artifact's own scheme (kvq_kv_desc_from_artifact): name like
 * "nuq4/4-1% (artifact)". Keys are quantized pre- or post-RoPE as the
 * artifact says. Allocates (free with kvq_qscheme_state_free). */
kvq_status kvq_qscheme_from_artifact(const kvq_artifact *a, kvq_qscheme_state *st, kvq_qscheme *out, kvq_err *err);
/* A table-free scheme (a family that needs no artifact: fp16, int, kivi,
 * ...), post-RoPE keys. */
kvq_status kvq_qscheme_plain(const kvq_scheme *sc, size_t head_dim, kvq_qscheme_state *st, kvq_qscheme *out,
                             kvq_err *err);
/* A parsed --scheme spec of a table-free family: kvq_qscheme_plain with the spec's key stage (the family's
 * default or +pre-rope / +post-rope) and rotation (+hadamard / +rht: every head vector rotated before the
 * family's quantize and un-rotated after it, kv_desc.h); named by the spec as given. KVQ_EINVAL for
 * +intactkv (a trained prefix has no resting representation to measure). */
kvq_status kvq_qscheme_spec(const kvq_scheme_spec *ss, size_t head_dim, kvq_qscheme_state *st, kvq_qscheme *out,
                            kvq_err *err);
void kvq_qscheme_state_free(kvq_qscheme_state *st);

#endif
