/* kvsrc.c — see kvsrc.h. */
#include "kvsrc.h"
#include "identity.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- dump source ---------------------------------------------------------------- */

static kvq_dump_ds ds_of(kvq_kvt t)
{
    switch (t) {
    case KVQ_KVT_K_PRE_ROPE: return KVQ_DUMP_K_PRE_ROPE;
    case KVQ_KVT_K: return KVQ_DUMP_K;
    case KVQ_KVT_V: return KVQ_DUMP_V;
    case KVQ_KVT_FISHER_K_PRE_ROPE: return KVQ_DUMP_FISHER_K_PRE_ROPE;
    case KVQ_KVT_FISHER_V: return KVQ_DUMP_FISHER_V;
    case KVQ_KVT_ATTN_RECEIVED: return KVQ_DUMP_ATTN_RECEIVED;
    case KVQ_KVT_COUNT: break;
    }
    return KVQ_DUMP_N_DS;
}

static kvq_status dump_read_rows(void *ctx, int layer, kvq_kvt t, int64_t sample, int64_t t0, int64_t n, float *out,
                                 kvq_err *err)
{
    kvq_dump_ds ds = ds_of(t);
    if (ds == KVQ_DUMP_N_DS) return kvq_fail(err, KVQ_EINVAL, "dump source: unknown tensor %d", (int)t);
    return kvq_dump_read_rows(ctx, layer, ds, sample, t0, n, out, err);
}

static kvq_status dump_read_tokens(void *ctx, int64_t s0, int64_t n, int32_t *out, kvq_err *err)
{
    return kvq_dump_read_tokens(ctx, s0, n, out, err);
}

kvq_status kvq_kvsrc_dump_open(const char *path, kvq_kvsrc *src, kvq_err *err)
{
    memset(src, 0, sizeof *src);
    kvq_dump_reader *r;
    KVQ_TRY(kvq_dump_open(path, &r, err));
    const kvq_dump_meta *m = kvq_dump_reader_meta(r);
    int64_t done = kvq_dump_reader_samples_done(r);
    if (done < 1) {
        kvq_dump_close(r);
        return kvq_fail(err, KVQ_EFORMAT, "%s: no sample committed yet (samples_done = %lld of %lld)", path,
                        (long long)done, (long long)m->n_samples);
    }
    { /* the model identity, as kvcalib reads it (a corrupted model_sha256 was accepted here and refused there) */
        char hex[65];
        kvq_status s = kvq_identity_model_from_dump(m, hex, err);
        if (s) {
            kvq_dump_close(r);
            return kvq_err_prefix(err, "%s", path);
        }
    }
    src->n_layers = m->n_layers;
    src->layer_first = m->layer_first;
    src->layer_last = m->layer_last;
    src->n_heads = m->n_heads;
    src->n_kv_heads = m->n_kv_heads;
    src->head_dim = m->head_dim;
    src->n_samples = done;
    src->seq_len = m->seq_len;
    src->has_fisher = m->has_fisher;
    src->has_attn = m->has_attn_stats;
    const char *b = strrchr(m->model_path, '/');
    const char *base = b ? b + 1 : m->model_path;
    size_t nb = strlen(base) < sizeof src->model - 1 ? strlen(base) : sizeof src->model - 1;
    memcpy(src->model, base, nb);
    src->model[nb] = 0;
    snprintf(src->model_sha256, sizeof src->model_sha256, "%s", m->model_sha256);
    src->ctx = r;
    src->read_rows = dump_read_rows;
    src->read_tokens = dump_read_tokens;
    return KVQ_OK;
}

void kvq_kvsrc_dump_close(kvq_kvsrc *src)
{
    if (src && src->read_rows == dump_read_rows) kvq_dump_close(src->ctx);
    if (src) memset(src, 0, sizeof *src);
}

const kvq_dump_meta *kvq_kvsrc_dump_meta(const kvq_kvsrc *src)
{
    return src && src->read_rows == dump_read_rows ? kvq_dump_reader_meta(src->ctx) : NULL;
}

kvq_status kvq_artifact_check_source(const kvq_artifact *a, const kvq_kvsrc *src, kvq_err *err)
{
    struct { const char *name; size_t art; long dump; } f[] = {
        {"n_layers", a->p.n_layers, src->n_layers},
        {"n_kv_heads", a->p.n_kv_heads, src->n_kv_heads},
        {"head_dim", a->p.head_dim, src->head_dim},
    };
    for (size_t i = 0; i < sizeof f / sizeof *f; i++)
        if ((long)f[i].art != f[i].dump)
            return kvq_fail(err, KVQ_EMISMATCH,
                            "artifact for another model: kvq.%s is %zu in the artifact but %ld in the dump (model %s)",
                            f[i].name, f[i].art, f[i].dump, src->model);
    return KVQ_OK;
}

/* ---- schemes ------------------------------------------------------------------------ */

static kvq_status scheme_quantize(void *ctx, int layer, bool is_value, const float *in, size_t n_tokens, size_t kv_dim,
                                  float *out, uint64_t *n_outliers, uint64_t *n_elems, kvq_err *err)
{
    const kvq_qscheme_state *st = ctx;
    kvq_quant_counts c = {0};
    kvq_status r = kvq_kv_desc_quantize(&st->desc, layer, is_value ? 'v' : 'k', out, in, n_tokens, kv_dim, st->head_dim, &c, err);
    *n_outliers += c.n_outliers;
    *n_elems += c.n_elems;
    return r;
}

static void fill_qscheme(kvq_qscheme_state *st, kvq_qscheme *q)
{
    memset(q, 0, sizeof *q);
    q->name = st->name;
    q->ctx = st;
    q->keys_post_rope = st->desc.key_stage == KVQ_KEYS_POST_ROPE;
    q->quantize = scheme_quantize;
    q->calib_outlier_frac_k = st->calib_k;
    q->calib_outlier_frac_v = st->calib_v;
}

kvq_status kvq_qscheme_from_artifact(const kvq_artifact *a, kvq_qscheme_state *st, kvq_qscheme *out, kvq_err *err)
{
    memset(st, 0, sizeof *st);
    const kvq_artifact_params *p = &a->p;
    KVQ_TRY(kvq_kv_desc_from_artifact(a, &st->desc, &st->tables, err));
    kvq_status s = kvq_scheme_validate(&st->desc.q, err);
    if (s) {
        kvq_qscheme_state_free(st);
        return s;
    }
    st->head_dim = p->head_dim;
    char frac[32] = "";
    if (p->outlier_frac > 0) snprintf(frac, sizeof frac, "-%g%%", p->outlier_frac * 100);
    char rot[48] = ""; /* fitted on rotated K / V (kvcalib --rotate): quantized through the same rotation */
    kvq_rotation_spec(&p->rotation, rot, sizeof rot);
    snprintf(st->name, sizeof st->name, "%s%d/%d%s%s%s (artifact)", p->method->name, p->k_bits, p->v_bits, frac,
             p->post_rope ? " post-RoPE" : "", rot);
    if (p->method->code_bits) { /* bits per code are not bits per element (cq-c4b8): the canonical spec instead */
        char spec[40];
        p->method->format(&st->desc.q, spec, sizeof spec);
        snprintf(st->name, sizeof st->name, "%s%s%s (artifact)", spec, p->post_rope ? " post-RoPE" : "", rot);
    }
    if (a->k && a->v) {
        st->calib_k = calloc(p->n_layers, sizeof(double));
        st->calib_v = calloc(p->n_layers, sizeof(double));
        if (!st->calib_k || !st->calib_v) { kvq_qscheme_state_free(st); return kvq_fail(err, KVQ_ENOMEM, "out of memory"); }
        for (size_t i = 0; i < p->n_layers; i++) {
            st->calib_k[i] = a->k[i].n_elems ? (double)a->k[i].n_outliers / (double)a->k[i].n_elems : NAN;
            st->calib_v[i] = a->v[i].n_elems ? (double)a->v[i].n_outliers / (double)a->v[i].n_elems : NAN;
        }
    }
    fill_qscheme(st, out);
    return KVQ_OK;
}

kvq_status kvq_qscheme_plain(const kvq_scheme *sc, size_t head_dim, kvq_qscheme_state *st, kvq_qscheme *out,
                             kvq_err *err)
{
    memset(st, 0, sizeof *st);
    if (!sc->fam || (sc->fam->needs_artifact && sc->fam->needs_artifact(sc)))
        return kvq_fail(err, KVQ_EINVAL, "plain scheme: %s needs an artifact's tables", sc->fam ? sc->fam->name : "(none)");
    KVQ_TRY(kvq_scheme_validate(sc, err));
    st->desc = (kvq_kv_desc){.q = *sc, .key_stage = KVQ_KEYS_POST_ROPE};
    st->head_dim = head_dim;
    const char *fn = sc->fam->name;
    if (!strcmp(fn, "int")) {
        if (sc->group) snprintf(st->name, sizeof st->name, "int%d/%d per-token g%zu", sc->k_bits, sc->v_bits, sc->group);
        else snprintf(st->name, sizeof st->name, "int%d/%d per-token", sc->k_bits, sc->v_bits);
    } else if (!strcmp(fn, "kivi")) {
        snprintf(st->name, sizeof st->name, "kivi%d/%d G%zu", sc->k_bits, sc->v_bits, sc->group);
    } else {
        sc->fam->format(sc, st->name, sizeof st->name);
    }
    fill_qscheme(st, out);
    return KVQ_OK;
}

kvq_status kvq_qscheme_spec(const kvq_scheme_spec *ss, size_t head_dim, kvq_qscheme_state *st, kvq_qscheme *out,
                            kvq_err *err)
{
    if (ss->intactkv)
        return kvq_fail(err, KVQ_EINVAL, "%s: +intactkv changes the prefix the model attends to, not the cached K/V; "
                        "kvstat measures the resting cache (drop the modifier)", ss->spec);
    KVQ_TRY(kvq_qscheme_plain(&ss->q, head_dim, st, out, err));
    st->desc.key_stage = ss->key_stage;
    st->desc.rot = ss->rot;
    kvq_kv_desc_name(&st->desc, st->name, sizeof st->name); /* canonical, with +sink and the rotation */
    if (ss->stage_set) {
        size_t w = strlen(st->name);
        snprintf(st->name + w, sizeof st->name - w, "%s", ss->key_stage == KVQ_KEYS_PRE_ROPE ? "+pre-rope" : "+post-rope");
    }
    fill_qscheme(st, out);
    return KVQ_OK;
}

void kvq_qscheme_state_free(kvq_qscheme_state *st)
{
    if (!st) return;
    free(st->tables);
    free(st->calib_k);
    free(st->calib_v);
    st->tables = NULL;
    st->calib_k = st->calib_v = NULL;
}
