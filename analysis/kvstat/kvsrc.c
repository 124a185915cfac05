/* kvsrc.c — see kvsrc.h. */
#include "kvsrc.h"

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
    const kvq_scheme *s = &st->scheme;
    kvq_quant_counts c = {0};
    kvq_status r = KVQ_OK;
    int bits = is_value ? s->v_bits : s->k_bits;
    switch (s->kind) {
    case KVQ_SCHEME_FP32:
        memcpy(out, in, n_tokens * kv_dim * sizeof(float));
        c.n_elems = n_tokens * kv_dim;
        break;
    case KVQ_SCHEME_FP16: kvq_quant_fp16(out, in, n_tokens * kv_dim, &c); break;
    case KVQ_SCHEME_INT:
        r = kvq_quant_int_token(out, in, n_tokens, kv_dim, s->group, bits, s->n_sink, &c, err);
        break;
    case KVQ_SCHEME_INT_PC: {
        if (is_value) { r = kvq_quant_int_token(out, in, n_tokens, kv_dim, s->group, bits, s->n_sink, &c, err); break; }
        const kvq_kv_table *t = &st->art->k[layer];
        r = kvq_quant_int_channel(out, in, n_tokens, kv_dim, t->channel_lower, t->channel_upper, bits,
                                  s->outlier_frac > 0, s->n_sink, &c, err);
        break;
    }
    case KVQ_SCHEME_NUQ: {
        const kvq_kv_table *t = is_value ? &st->art->v[layer] : &st->art->k[layer];
        kvq_nuq_lut lut = {t->bits, t->n_tables, st->head_dim, t->levels};
        if (is_value) r = kvq_quant_nuq_values(out, in, n_tokens, kv_dim, &lut, s->outlier_frac, s->n_sink, &c, err);
        else
            r = kvq_quant_nuq_keys(out, in, n_tokens, kv_dim, &lut, t->channel_lower, t->channel_upper,
                                   s->outlier_frac > 0, s->n_sink, &c, err);
        break;
    }
    case KVQ_SCHEME_KIVI:
        r = is_value ? kvq_kivi_values(out, in, n_tokens, kv_dim, st->head_dim, s->group, bits, s->n_sink, &c, err)
                     : kvq_kivi_keys(out, in, n_tokens, kv_dim, s->group, bits, s->n_sink, &c, err);
        break;
    default: r = kvq_fail(err, KVQ_EUNSUPPORTED, "kvstat: scheme kind %d is evaluated by kveval only", (int)s->kind); break;
    }
    *n_outliers += c.n_outliers;
    *n_elems += c.n_elems;
    return r;
}

static void fill_qscheme(kvq_qscheme_state *st, kvq_qscheme *q, bool post_rope)
{
    memset(q, 0, sizeof *q);
    q->name = st->name;
    q->ctx = st;
    q->keys_post_rope = post_rope;
    q->quantize = scheme_quantize;
    q->calib_outlier_frac_k = st->calib_k;
    q->calib_outlier_frac_v = st->calib_v;
}

kvq_status kvq_qscheme_from_artifact(const kvq_artifact *a, kvq_qscheme_state *st, kvq_qscheme *out, kvq_err *err)
{
    memset(st, 0, sizeof *st);
    const kvq_artifact_params *p = &a->p;
    kvq_scheme s = {.k_bits = p->k_bits, .v_bits = p->v_bits, .outlier_frac = p->outlier_frac, .n_sink = p->n_sink,
                    .group = p->group_size, .residual = p->residual_length};
    switch (p->method) {
    case KVQ_METHOD_NUQ: s.kind = KVQ_SCHEME_NUQ; break;
    case KVQ_METHOD_INT: s.kind = KVQ_SCHEME_INT; break;
    case KVQ_METHOD_INT_PC: s.kind = KVQ_SCHEME_INT_PC; break;
    case KVQ_METHOD_KIVI: s.kind = KVQ_SCHEME_KIVI; break;
    case KVQ_METHOD_FP8:
        return kvq_fail(err, KVQ_EUNSUPPORTED, "artifact: method fp8 (FP8 cache scales) is evaluated by kveval "
                        "(--scheme fp8-tensor / fp8-head); kvstat takes nuq, int, int-pc and kivi artifacts");
    default: return kvq_fail(err, KVQ_EUNSUPPORTED, "artifact: method %d unknown", (int)p->method);
    }
    if ((s.kind == KVQ_SCHEME_NUQ || s.kind == KVQ_SCHEME_INT_PC) && (!a->k || (s.kind == KVQ_SCHEME_NUQ && !a->v)))
        return kvq_fail(err, KVQ_EFORMAT, "artifact: method %s without tables", kvq_method_name(p->method));
    KVQ_TRY(kvq_scheme_validate(&s, err));
    st->scheme = s;
    st->art = a;
    st->head_dim = p->head_dim;
    char frac[32] = "";
    if (p->outlier_frac > 0) snprintf(frac, sizeof frac, "-%g%%", p->outlier_frac * 100);
    snprintf(st->name, sizeof st->name, "%s%d/%d%s%s (artifact)", kvq_method_name(p->method), p->k_bits, p->v_bits,
             frac, p->post_rope ? " post-RoPE" : "");
    if (a->k && a->v) {
        st->calib_k = calloc(p->n_layers, sizeof(double));
        st->calib_v = calloc(p->n_layers, sizeof(double));
        if (!st->calib_k || !st->calib_v) { kvq_qscheme_state_free(st); return kvq_fail(err, KVQ_ENOMEM, "out of memory"); }
        for (size_t i = 0; i < p->n_layers; i++) {
            st->calib_k[i] = a->k[i].n_elems ? (double)a->k[i].n_outliers / (double)a->k[i].n_elems : NAN;
            st->calib_v[i] = a->v[i].n_elems ? (double)a->v[i].n_outliers / (double)a->v[i].n_elems : NAN;
        }
    }
    fill_qscheme(st, out, p->post_rope || s.kind == KVQ_SCHEME_INT || s.kind == KVQ_SCHEME_KIVI);
    return KVQ_OK;
}

kvq_status kvq_qscheme_plain(const kvq_scheme *sc, size_t head_dim, kvq_qscheme_state *st, kvq_qscheme *out,
                             kvq_err *err)
{
    memset(st, 0, sizeof *st);
    if (sc->kind != KVQ_SCHEME_FP16 && sc->kind != KVQ_SCHEME_INT && sc->kind != KVQ_SCHEME_KIVI &&
        sc->kind != KVQ_SCHEME_FP32)
        return kvq_fail(err, KVQ_EINVAL, "plain scheme: nuq and int-pc need an artifact's tables");
    KVQ_TRY(kvq_scheme_validate(sc, err));
    st->scheme = *sc;
    st->head_dim = head_dim;
    switch (sc->kind) {
    case KVQ_SCHEME_FP16: snprintf(st->name, sizeof st->name, "fp16"); break;
    case KVQ_SCHEME_FP32: snprintf(st->name, sizeof st->name, "fp32"); break;
    case KVQ_SCHEME_INT:
        if (sc->group) snprintf(st->name, sizeof st->name, "int%d/%d per-token g%zu", sc->k_bits, sc->v_bits, sc->group);
        else snprintf(st->name, sizeof st->name, "int%d/%d per-token", sc->k_bits, sc->v_bits);
        break;
    default: snprintf(st->name, sizeof st->name, "kivi%d/%d G%zu", sc->k_bits, sc->v_bits, sc->group); break;
    }
    fill_qscheme(st, out, true);
    return KVQ_OK;
}

void kvq_qscheme_state_free(kvq_qscheme_state *st)
{
    if (!st) return;
    free(st->calib_k);
    free(st->calib_v);
    st->calib_k = st->calib_v = NULL;
}
