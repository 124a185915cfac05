/* kv_desc.c — built-in KV transforms as data; CPU reference hook. See kv_desc.h. */
#include "kv_desc.h"

#include <math.h>
#include <stdio.h>

static kvq_status check_lut(const kvq_nuq_lut *l, int bits, int layer, char kv, const kvq_hparams *hp, kvq_err *err)
{
    if (!l->levels) return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: %c levels missing (nuq)", layer, kv);
    if (l->bits != bits)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: %c levels: expected %d bits, found %d", layer, kv, bits, l->bits);
    if (l->n_tables != 1 && (l->n_tables != (size_t)hp->n_kv_heads || l->head_dim != (size_t)hp->head_dim))
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: %c levels: expected 1 or %d tables of head_dim %d, found %zu of %zu",
                        layer, kv, hp->n_kv_heads, hp->head_dim, l->n_tables, l->head_dim);
    size_t nl = (size_t)1 << bits;
    for (size_t t = 0; t < l->n_tables; t++)
        for (size_t j = 0; j < nl; j++) {
            float x = l->levels[t * nl + j];
            if (!isfinite(x) || (j && x < l->levels[t * nl + j - 1]))
                return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: %c table %zu level %zu: expected finite and ascending, found %g",
                                layer, kv, t, j, (double)x);
        }
    return KVQ_OK;
}

kvq_status kvq_kv_desc_validate(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    if (!d) return kvq_fail(err, KVQ_EINVAL, "kv descriptor: NULL");
    KVQ_TRY(kvq_scheme_validate(&d->q, err));
    if (d->q.kind == KVQ_SCHEME_FP8 || d->q.kind == KVQ_SCHEME_GGML)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "kv descriptor: %s is not a built-in descriptor (kveval's CPU scheme registry, "
                        "analysis/kveval/scheme.c, evaluates it)", d->q.kind == KVQ_SCHEME_FP8 ? "fp8" : "a llama.cpp block format");
    if (d->key_stage != KVQ_KEYS_PRE_ROPE && d->key_stage != KVQ_KEYS_POST_ROPE)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: key stage: unknown value %d", (int)d->key_stage);
    size_t kvd = (size_t)kvq_kv_dim(hp);
    const kvq_scheme *q = &d->q;
    if ((q->kind == KVQ_SCHEME_INT || q->kind == KVQ_SCHEME_INT_PC) && q->group && kvd % q->group)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: int%s group size %zu does not divide kv_dim %zu",
                        q->kind == KVQ_SCHEME_INT_PC ? "-pc value" : "", q->group, kvd);
    if (q->kind == KVQ_SCHEME_KIVI && (size_t)hp->head_dim % q->group)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: kivi group size %zu does not divide head_dim %d", q->group, hp->head_dim);
    if (q->kind == KVQ_SCHEME_INT_PC || q->kind == KVQ_SCHEME_NUQ) {
        if (!d->layers || d->n_layers != hp->n_layers)
            return kvq_fail(err, KVQ_EINVAL, "kv descriptor: %s needs tables for %d layers, found %d",
                            q->kind == KVQ_SCHEME_NUQ ? "nuq" : "int per-channel", hp->n_layers, d->layers ? d->n_layers : 0);
        for (int l = 0; l < hp->n_layers; l++) {
            const kvq_kv_layer_tables *t = &d->layers[l];
            if (!t->k_lower || !t->k_upper)
                return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: key channel thresholds missing", l);
            for (size_t c = 0; c < kvd; c++)
                if (!isfinite(t->k_lower[c]) || !isfinite(t->k_upper[c]) || t->k_lower[c] > t->k_upper[c])
                    return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: channel %zu: expected finite lower <= upper, found [%g, %g]",
                                    l, c, (double)t->k_lower[c], (double)t->k_upper[c]);
            if (q->kind == KVQ_SCHEME_NUQ) {
                KVQ_TRY(check_lut(&t->k_lut, q->k_bits, l, 'k', hp, err));
                KVQ_TRY(check_lut(&t->v_lut, q->v_bits, l, 'v', hp, err));
            }
        }
    }
    return KVQ_OK;
}

bool kvq_kv_desc_is_identity(const kvq_kv_desc *d) { return !d || d->q.kind == KVQ_SCHEME_FP32; }

void kvq_kv_desc_name(const kvq_kv_desc *d, char *buf, size_t n)
{
    const kvq_scheme *q = &d->q;
    int w = 0;
    char pct[32] = "";
    if (q->outlier_frac > 0) snprintf(pct, sizeof pct, "-%g%%", q->outlier_frac * 100);
    switch (q->kind) {
    case KVQ_SCHEME_FP32: w = snprintf(buf, n, "fp32"); break;
    case KVQ_SCHEME_FP16: w = snprintf(buf, n, "fp16"); break;
    case KVQ_SCHEME_INT:
        w = q->group ? snprintf(buf, n, "int%d-g%zu", q->k_bits, q->group) : snprintf(buf, n, "int%d", q->k_bits);
        break;
    case KVQ_SCHEME_INT_PC: w = snprintf(buf, n, "int%d-pc%s", q->k_bits, pct); break;
    case KVQ_SCHEME_NUQ: w = snprintf(buf, n, "nuq%d%s", q->k_bits, pct); break;
    case KVQ_SCHEME_KIVI: w = snprintf(buf, n, "kivi%d-g%zu-r%zu", q->k_bits, q->group, q->residual); break;
    case KVQ_SCHEME_FP8: w = snprintf(buf, n, "fp8"); break;
    case KVQ_SCHEME_GGML: w = snprintf(buf, n, "llama.cpp-%d", q->k_bits); break;
    }
    if (w >= 0 && (size_t)w < n && q->n_sink && q->kind != KVQ_SCHEME_FP32)
        snprintf(buf + w, n - (size_t)w, "+sink%zu", q->n_sink);
}

kvq_status kvq_kv_desc_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    kvq_kv_desc_run *run = user;
    const kvq_kv_desc *d = run->d;
    const kvq_scheme *q = &d->q;
    size_t kvd = (size_t)c->n_kv_heads * c->head_dim, T = (size_t)c->T;
    switch (q->kind) {
    case KVQ_SCHEME_FP32: return KVQ_OK;
    case KVQ_SCHEME_FP16: {
        size_t ns = q->n_sink < T ? q->n_sink : T;
        kvq_quant_fp16(k + ns * kvd, k + ns * kvd, (T - ns) * kvd, &run->k_counts);
        kvq_quant_fp16(v + ns * kvd, v + ns * kvd, (T - ns) * kvd, &run->v_counts);
        run->k_counts.n_sink += ns * kvd;
        run->v_counts.n_sink += ns * kvd;
        run->k_counts.n_elems += ns * kvd;
        run->v_counts.n_elems += ns * kvd;
        return KVQ_OK;
    }
    case KVQ_SCHEME_INT:
        KVQ_TRY(kvq_quant_int_token(k, k, T, kvd, q->group, q->k_bits, q->n_sink, &run->k_counts, err));
        return kvq_quant_int_token(v, v, T, kvd, q->group, q->v_bits, q->n_sink, &run->v_counts, err);
    case KVQ_SCHEME_INT_PC: {
        const kvq_kv_layer_tables *t = &d->layers[c->layer];
        KVQ_TRY(kvq_quant_int_channel(k, k, T, kvd, t->k_lower, t->k_upper, q->k_bits, q->outlier_frac > 0, q->n_sink,
                                      &run->k_counts, err));
        return kvq_quant_int_token(v, v, T, kvd, q->group, q->v_bits, q->n_sink, &run->v_counts, err); /* values: per-token groups */
    }
    case KVQ_SCHEME_NUQ: {
        const kvq_kv_layer_tables *t = &d->layers[c->layer];
        KVQ_TRY(kvq_quant_nuq_keys(k, k, T, kvd, &t->k_lut, t->k_lower, t->k_upper, q->outlier_frac > 0, q->n_sink,
                                   &run->k_counts, err));
        return kvq_quant_nuq_values(v, v, T, kvd, &t->v_lut, q->outlier_frac, q->n_sink, &run->v_counts, err);
    }
    case KVQ_SCHEME_KIVI:
        KVQ_TRY(kvq_kivi_keys(alt->k, k, T, kvd, q->group, q->k_bits, q->n_sink, &run->k_counts, err));
        KVQ_TRY(kvq_kivi_values(alt->v, v, T, kvd, (size_t)c->head_dim, q->group, q->v_bits, q->n_sink, &run->v_counts, err));
        kvq_kv_desc_kivi_bounds(q, T, alt->k_bound, alt->v_bound);
        alt->use_k = alt->use_v = true;
        return KVQ_OK;
    case KVQ_SCHEME_FP8:
    case KVQ_SCHEME_GGML: break; /* rejected by kvq_kv_desc_validate */
    }
    return kvq_fail(err, KVQ_EINVAL, "kv descriptor: kind: unknown value %d", (int)q->kind);
}

void kvq_kv_desc_kivi_bounds(const kvq_scheme *q, size_t T, int *kb, int *vb)
{
    for (size_t i = 0; i < T; i++) {
        kb[i] = (int)kvq_kivi_key_boundary(i, q->group, q->residual, q->n_sink);
        vb[i] = (int)kvq_kivi_value_boundary(i, q->residual, q->n_sink);
    }
}

void kvq_kv_desc_hooks(kvq_kv_desc_run *run, const kvq_kv_desc *d, kvq_hooks *hooks)
{
    run->d = d;
    *hooks = (kvq_hooks){.user = run, .transform = kvq_kv_desc_is_identity(d) ? NULL : kvq_kv_desc_transform,
                         .key_stage = d ? d->key_stage : KVQ_KEYS_POST_ROPE};
}
