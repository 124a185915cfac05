/* kveval_util.h — in-process calibration for kveval's tests and benchmark:
 * run the model over token windows, capture every layer's keys (pre- or
 * post-RoPE) and values with the forward's observe hook, fit nuqX tables
 * with kernels/quant/tables.h and write a kvcalib-style artifact (kernels/schemes/artifact.h).
 * A stand-in for `kvdump | kvcalib` where those are not available; the
 * tables are the same functions kvcalib calls (no Fisher weights). */
#ifndef KVQ_KVEVAL_UTIL_H
#define KVQ_KVEVAL_UTIL_H

#include <stdlib.h>
#include <string.h>

#include "artifact.h"
#include "family.h"
#include "forward.h"
#include "model.h"
#include "quant_fp8.h"
#include "tables.h"

typedef struct {
    float *k, *v;     /* [n_layers][n_rows][kv_dim] */
    size_t n_rows, row0, kvd;
    bool post_rope;
} kvq_util_capture;

static kvq_status kvq_util_capture_hook(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *err)
{
    (void)err;
    kvq_util_capture *cap = (kvq_util_capture *)user;
    size_t off = ((size_t)c->layer * cap->n_rows + cap->row0) * cap->kvd, n = (size_t)c->T * cap->kvd;
    memcpy(cap->k + off, cap->post_rope ? o->k_post : o->k_pre, n * sizeof(float));
    memcpy(cap->v + off, o->v, n * sizeof(float));
    return KVQ_OK;
}

/* Capture keys (post_rope: after RoPE, else before) and values of every
 * layer for n_samples windows of sample_len tokens ([n_samples][sample_len]).
 * Free cap->k / cap->v with free(). */
static kvq_status kvq_util_capture_kv(const kvq_model *m, const int *tokens, size_t n_samples, size_t sample_len,
                                      bool post_rope, kvq_util_capture *cap, kvq_err *err)
{
    const kvq_hparams *hp = &m->hp;
    size_t L = (size_t)hp->n_layers, kvd = (size_t)kvq_kv_dim(hp), rows = n_samples * sample_len;
    memset(cap, 0, sizeof *cap);
    cap->n_rows = rows;
    cap->kvd = kvd;
    cap->post_rope = post_rope;
    cap->k = (float *)malloc(L * rows * kvd * sizeof(float));
    cap->v = (float *)malloc(L * rows * kvd * sizeof(float));
    if (!cap->k || !cap->v) return kvq_fail(err, KVQ_ENOMEM, "calibration capture: out of memory");
    kvq_forward fw;
    KVQ_TRY(kvq_forward_init(&fw, m, (int)sample_len, 0, 0, err));
    kvq_hooks hk = {.user = cap, .observe = kvq_util_capture_hook};
    kvq_status s = KVQ_OK;
    for (size_t i = 0; !s && i < n_samples; i++) {
        cap->row0 = i * sample_len;
        kvq_fwd_io io = {.tokens = tokens + i * sample_len, .T = (int)sample_len, .hooks = &hk};
        kvq_fwd_result r;
        s = kvq_forward_run(&fw, &io, &r, err);
    }
    kvq_forward_free(&fw);
    return s;
}

/* Fit method nuq (k_bits = v_bits = bits, outlier fraction frac, n_sink
 * tokens of every sample excluded) on a capture and write the artifact to
 * path with the given model fingerprint; bits accounted at ctx. */
static kvq_status kvq_util_fit_nuq(const kvq_model *m, const kvq_util_capture *cap, size_t sample_len, int bits, double frac,
                                   size_t n_sink, size_t ctx, const char *fingerprint, const char *path, kvq_err *err)
{
    const kvq_hparams *hp = &m->hp;
    size_t L = (size_t)hp->n_layers, kvd = cap->kvd, rows = cap->n_rows;
    kvq_artifact a;
    memset(&a, 0, sizeof a);
    a.p.n_layers = L;
    a.k = (kvq_kv_table *)calloc(L, sizeof *a.k);
    a.v = (kvq_kv_table *)calloc(L, sizeof *a.v);
    kvq_status s = KVQ_OK;
    if (!a.k || !a.v) s = kvq_fail(err, KVQ_ENOMEM, "calibration: out of memory");
    a.p.method = KVQ_FAM("nuq");
    a.p.k_bits = a.p.v_bits = bits;
    a.p.outlier_frac = frac;
    a.p.n_sink = n_sink;
    a.p.post_rope = cap->post_rope;
    snprintf(a.p.fit, sizeof a.p.fit, "auto");
    a.p.n_kv_heads = (size_t)hp->n_kv_heads;
    a.p.head_dim = (size_t)hp->head_dim;
    snprintf(a.p.model_fingerprint, sizeof a.p.model_fingerprint, "%s", fingerprint);
    snprintf(a.p.dump_fingerprint, sizeof a.p.dump_fingerprint, "in-process capture: %zu x %zu tokens", rows / sample_len,
             sample_len);
    kvq_calib_opts o;
    memset(&o, 0, sizeof o);
    o.bits = bits;
    o.outlier_frac = frac;
    o.n_sink = n_sink;
    o.sample_len = sample_len;
    o.n_kv_heads = (size_t)hp->n_kv_heads;
    o.head_dim = (size_t)hp->head_dim;
    for (size_t l = 0; !s && l < L; l++) {
        s = kvq_calib_keys(cap->k + l * rows * kvd, NULL, rows, &o, &a.k[l], err);
        if (!s) s = kvq_calib_values(cap->v + l * rows * kvd, NULL, rows, &o, &a.v[l], err);
        if (s) kvq_err_prefix(err, "layer %zu", l);
    }
    if (!s) s = kvq_calib_fill_bits(&a.p, ctx, err);
    if (!s) s = kvq_artifact_write(path, &a, err);
    kvq_artifact_free(&a);
    return s;
}

/* Capture + fit in one call (tests). */
static kvq_status kvq_util_make_nuq_artifact(const kvq_model *m, const int *tokens, size_t n_samples, size_t sample_len,
                                             int bits, double frac, size_t n_sink, bool post_rope, const char *fingerprint,
                                             const char *path, kvq_err *err)
{
    kvq_util_capture cap;
    kvq_status s = kvq_util_capture_kv(m, tokens, n_samples, sample_len, post_rope, &cap, err);
    if (!s) s = kvq_util_fit_nuq(m, &cap, sample_len, bits, frac, n_sink, sample_len, fingerprint, path, err);
    free(cap.k);
    free(cap.v);
    return s;
}

/* Method fp8 on a post-RoPE capture: per layer, scales of K and V per tensor
 * or per KV head (kvq_fp8_calib_tensor / _heads with the percentile), as
 * kvcalib --method fp8 computes them without sink tokens; written to path. */
static inline kvq_status kvq_util_make_fp8_artifact(const kvq_model *m, const int *tokens, size_t n_samples, size_t sample_len,
                                                    bool per_head, double percentile, bool e5m2, const char *fingerprint,
                                             const char *path, kvq_err *err)
{
    const kvq_hparams *hp = &m->hp;
    size_t L = (size_t)hp->n_layers, H = (size_t)hp->n_kv_heads, D = (size_t)hp->head_dim, n_sc = per_head ? H : 1;
    kvq_util_capture cap;
    kvq_status s = kvq_util_capture_kv(m, tokens, n_samples, sample_len, true, &cap, err);
    kvq_artifact a;
    memset(&a, 0, sizeof a);
    a.p.method = KVQ_FAM("fp8");
    a.p.k_bits = a.p.v_bits = 8;
    a.p.post_rope = true;
    a.p.per_head = per_head;
    a.p.fp8_e5m2 = e5m2;
    a.p.fp8_percentile = percentile;
    a.p.n_layers = L;
    a.p.n_kv_heads = H;
    a.p.head_dim = D;
    snprintf(a.p.model_fingerprint, sizeof a.p.model_fingerprint, "%s", fingerprint);
    snprintf(a.p.dump_fingerprint, sizeof a.p.dump_fingerprint, "in-process capture");
    a.k = (kvq_kv_table *)calloc(L, sizeof *a.k);
    a.v = (kvq_kv_table *)calloc(L, sizeof *a.v);
    if (!s && (!a.k || !a.v)) s = kvq_fail(err, KVQ_ENOMEM, "fp8 artifact: out of memory");
    kvq_fp8_format f = e5m2 ? KVQ_FP8_E5M2 : KVQ_FP8_E4M3FN;
    for (size_t l = 0; !s && l < L; l++)
        for (int w = 0; !s && w < 2; w++) {
            kvq_kv_table *t = w ? &a.v[l] : &a.k[l];
            const float *x = (w ? cap.v : cap.k) + l * cap.n_rows * cap.kvd;
            t->bits = 8;
            t->kv_dim = cap.kvd;
            t->n_fp8_scales = n_sc;
            t->fp8_scale = (float *)malloc(n_sc * sizeof(float));
            if (!t->fp8_scale) { s = kvq_fail(err, KVQ_ENOMEM, "fp8 artifact: out of memory"); break; }
            s = per_head ? kvq_fp8_calib_heads(f, x, cap.n_rows, H, D, percentile, t->fp8_scale, err)
                         : kvq_fp8_calib_tensor(f, x, cap.n_rows, H, D, percentile, t->fp8_scale, err);
        }
    if (!s) s = kvq_calib_fill_bits(&a.p, sample_len, err);
    if (!s) s = kvq_artifact_write(path, &a, err);
    kvq_artifact_free(&a);
    free(cap.k);
    free(cap.v);
    return s;
}

/* Method nvfp4 on a post-RoPE capture: the family's own fit (what kvcalib --method nvfp4 runs on a
 * dump) per layer for K and V, absmax or a percentile, no sink tokens; written to path. */
static inline kvq_status kvq_util_make_nvfp4_artifact(const kvq_model *m, const int *tokens, size_t n_samples,
                                                      size_t sample_len, double percentile, const char *fingerprint,
                                                      const char *path, kvq_err *err)
{
    const kvq_hparams *hp = &m->hp;
    size_t L = (size_t)hp->n_layers, H = (size_t)hp->n_kv_heads, D = (size_t)hp->head_dim;
    kvq_util_capture cap;
    kvq_status s = kvq_util_capture_kv(m, tokens, n_samples, sample_len, true, &cap, err);
    kvq_artifact a;
    memset(&a, 0, sizeof a);
    a.p.method = KVQ_FAM("nvfp4");
    a.p.k_bits = a.p.v_bits = 4;
    a.p.post_rope = true;
    a.p.fp8_percentile = percentile;
    a.p.n_layers = L;
    a.p.n_kv_heads = H;
    a.p.head_dim = D;
    snprintf(a.p.model_fingerprint, sizeof a.p.model_fingerprint, "%s", fingerprint);
    snprintf(a.p.dump_fingerprint, sizeof a.p.dump_fingerprint, "in-process capture");
    a.k = (kvq_kv_table *)calloc(L, sizeof *a.k);
    a.v = (kvq_kv_table *)calloc(L, sizeof *a.v);
    float *x = s ? NULL : (float *)malloc(cap.n_rows * cap.kvd * sizeof(float));
    if (!s && (!a.k || !a.v || !x)) s = kvq_fail(err, KVQ_ENOMEM, "nvfp4 artifact: out of memory");
    for (size_t l = 0; !s && l < L; l++)
        for (int w = 0; !s && w < 2; w++) {
            memcpy(x, (w ? cap.v : cap.k) + l * cap.n_rows * cap.kvd, cap.n_rows * cap.kvd * sizeof(float));
            kvq_fit_input in = {.x = x, .n_tokens = cap.n_rows, .sample_len = sample_len, .n_kv_heads = H, .head_dim = D};
            s = a.p.method->calib->fit(&a.p, w ? 'v' : 'k', &in, w ? &a.v[l] : &a.k[l], err);
        }
    free(x);
    if (!s) s = kvq_calib_fill_bits(&a.p, sample_len, err);
    if (!s) s = kvq_artifact_write(path, &a, err);
    kvq_artifact_free(&a);
    free(cap.k);
    free(cap.v);
    return s;
}

#endif
