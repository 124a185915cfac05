/* kv_desc.c — a bound scheme run through its family; see kv_desc.h. */
#include "kv_desc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kvq_status kvq_kv_desc_validate(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    if (!d) return kvq_fail(err, KVQ_EINVAL, "kv descriptor: NULL");
    KVQ_TRY(kvq_scheme_validate(&d->q, err));
    if (d->key_stage != KVQ_KEYS_PRE_ROPE && d->key_stage != KVQ_KEYS_POST_ROPE)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: key stage: unknown value %d", (int)d->key_stage);
    const kvq_family *f = d->q.fam;
    if (d->rot.kind != KVQ_ROT_NONE && kvq_rotation_check(&d->rot, (size_t)hp->head_dim, err))
        return kvq_err_prefix(err, "kv descriptor");
    if (f->check_model) KVQ_TRY(f->check_model(&d->q, "kv descriptor", hp, err));
    if (f->check_tables) KVQ_TRY(f->check_tables(d, hp, err));
    return KVQ_OK;
}

bool kvq_kv_desc_is_identity(const kvq_kv_desc *d)
{
    return !d || !d->q.fam || (d->q.fam->identity && d->rot.kind == KVQ_ROT_NONE);
}

const kvq_family_cuda *kvq_kv_desc_cuda(const kvq_kv_desc *d)
{
    return d && d->q.fam && d->rot.kind == KVQ_ROT_NONE ? d->q.fam->cuda : NULL;
}

void kvq_kv_desc_name(const kvq_kv_desc *d, char *buf, size_t n)
{
    if (!n) return;
    if (!d->q.fam) {
        snprintf(buf, n, "?");
        return;
    }
    d->q.fam->format(&d->q, buf, n);
    size_t w = strlen(buf);
    if (w < n && d->q.n_sink && !d->q.fam->identity) snprintf(buf + w, n - w, "+sink%zu", d->q.n_sink);
    w = strlen(buf);
    if (w < n) kvq_rotation_spec(&d->rot, buf + w, n - w);
}

bool kvq_kv_desc_alt_bounds(const kvq_kv_desc *d, size_t T, int *kb, int *vb)
{
    if (!d || !d->q.fam || !d->q.fam->alt_bounds) return false;
    d->q.fam->alt_bounds(&d->q, T, kb, vb);
    return true;
}

kvq_status kvq_kv_desc_run_init(kvq_kv_desc_run *run, const kvq_kv_desc *d, kvq_err *err)
{
    memset(run, 0, sizeof *run);
    run->d = d;
    if (d && d->q.fam && d->q.fam->run_init) return d->q.fam->run_init(run, err);
    return KVQ_OK;
}

void kvq_kv_desc_run_free(kvq_kv_desc_run *run)
{
    if (run && run->state && run->d && run->d->q.fam && run->d->q.fam->run_free) run->d->q.fam->run_free(run);
    if (run) run->state = NULL;
}

/* Un-rotate what the family's transform produced: k, v in place, and the alternatives or each distinct
 * buffer of a schedule (a buffer may be shared between representations, or be k / v themselves). */
static kvq_status unrotate_outputs(const kvq_kv_desc *d, size_t T, size_t kvd, size_t hd, float *k, float *v,
                                   const kvq_kv_alt *alt, kvq_err *err)
{
    KVQ_TRY(kvq_rotation_apply(&d->rot, k, T, kvd, hd, 'k', true, err));
    KVQ_TRY(kvq_rotation_apply(&d->rot, v, T, kvd, hd, 'v', true, err));
    if (!alt) return KVQ_OK;
    if (alt->sched) {
        const kvq_kv_sched *s = alt->sched;
        float *done[2 * KVQ_KV_MAX_REPS + 2] = {k, v};
        size_t n_done = 2;
        for (int side = 0; side < 2; side++)
            for (int r = 0; r < (side ? s->n_v : s->n_k) && r < KVQ_KV_MAX_REPS; r++) {
                float *b = side ? s->v[r] : s->k[r];
                bool seen = !b;
                for (size_t i = 0; i < n_done && !seen; i++) seen = done[i] == b;
                if (seen) continue;
                done[n_done++] = b;
                KVQ_TRY(kvq_rotation_apply(&d->rot, b, T, kvd, hd, side ? 'v' : 'k', true, err));
            }
        return KVQ_OK;
    }
    if (alt->use_k) KVQ_TRY(kvq_rotation_apply(&d->rot, alt->k, T, kvd, hd, 'k', true, err));
    if (alt->use_v) KVQ_TRY(kvq_rotation_apply(&d->rot, alt->v, T, kvd, hd, 'v', true, err));
    return KVQ_OK;
}

kvq_status kvq_kv_desc_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    kvq_kv_desc_run *run = user;
    const kvq_kv_desc *d = run->d;
    const kvq_family *f = d->q.fam;
    if (!f) return kvq_fail(err, KVQ_EINVAL, "kv descriptor: no family");
    if (kvq_kv_desc_is_identity(d)) return KVQ_OK;
    bool rot = d->rot.kind != KVQ_ROT_NONE;
    size_t T = (size_t)c->T, hd = (size_t)c->head_dim, kvd = (size_t)c->n_kv_heads * hd;
    if (rot) {
        KVQ_TRY(kvq_rotation_apply(&d->rot, k, T, kvd, hd, 'k', false, err));
        KVQ_TRY(kvq_rotation_apply(&d->rot, v, T, kvd, hd, 'v', false, err));
    }
    kvq_status s = f->identity ? KVQ_OK
                   : f->transform ? f->transform(run, c, k, v, alt, err)
                                  : kvq_family_transform_in_place(run, c, k, v, err);
    if (s || !rot) return s;
    return unrotate_outputs(d, T, kvd, hd, k, v, alt, err);
}

kvq_status kvq_kv_desc_quantize(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t n_tokens,
                                size_t kv_dim, size_t head_dim, kvq_quant_counts *c, kvq_err *err)
{
    bool rot = d && d->rot.kind != KVQ_ROT_NONE;
    if (!d || !d->q.fam || (!d->q.fam->quantize && !(rot && d->q.fam->identity)))
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: no quantizer");
    if (side != 'k' && side != 'v') return kvq_fail(err, KVQ_EINVAL, "kv descriptor: side '%c': expected 'k' or 'v'", side);
    if (head_dim == 0 || kv_dim % head_dim)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: head_dim %zu does not divide kv_dim %zu", head_dim, kv_dim);
    if (!rot) return d->q.fam->quantize(d, layer, side, out, in, n_tokens, kv_dim, head_dim, c, err);
    /* the cache holds Q(x·R); read back as Q(x·R)·Rᵀ */
    if (out != in) memmove(out, in, n_tokens * kv_dim * sizeof *out);
    KVQ_TRY(kvq_rotation_apply(&d->rot, out, n_tokens, kv_dim, head_dim, side, false, err));
    if (!d->q.fam->identity) KVQ_TRY(d->q.fam->quantize(d, layer, side, out, out, n_tokens, kv_dim, head_dim, c, err));
    return kvq_rotation_apply(&d->rot, out, n_tokens, kv_dim, head_dim, side, true, err);
}

int kvq_kv_desc_chunk(const kvq_kv_desc *d)
{
    return d && d->q.fam && d->q.fam->chunk && !kvq_kv_desc_is_identity(d) ? d->q.fam->chunk(&d->q) : 0;
}

kvq_status kvq_kv_desc_cache(void *user, int P, kvq_prefix *out, kvq_err *err)
{
    kvq_kv_desc_run *run = user;
    const kvq_family *f = run->d ? run->d->q.fam : NULL;
    if (!f || !f->cache) return kvq_fail(err, KVQ_EINVAL, "kv descriptor: family %s builds no cache", f ? f->name : "?");
    return f->cache(run, P, out, err);
}

void kvq_kv_desc_hooks(kvq_kv_desc_run *run, const kvq_kv_desc *d, kvq_hooks *hooks)
{
    run->d = d;
    *hooks = (kvq_hooks){.user = run, .transform = kvq_kv_desc_is_identity(d) ? NULL : kvq_kv_desc_transform,
                         .key_stage = d ? d->key_stage : KVQ_KEYS_POST_ROPE, .chunk = kvq_kv_desc_chunk(d),
                         .cache = kvq_kv_desc_chunk(d) ? kvq_kv_desc_cache : NULL};
}

kvq_status kvq_kv_layer_tables_view(const kvq_artifact *a, kvq_kv_layer_tables **out, kvq_err *err)
{
    size_t L = a->p.n_layers;
    kvq_kv_layer_tables *t = calloc(L ? L : 1, sizeof *t);
    if (!t) return kvq_fail(err, KVQ_ENOMEM, "cannot allocate table views for %zu layers", L);
    for (size_t l = 0; l < L; l++) {
        if (a->k) {
            const kvq_kv_table *kt = &a->k[l];
            t[l].k_lower = kt->channel_lower;
            t[l].k_upper = kt->channel_upper;
            if (kt->levels)
                t[l].k_lut = (kvq_nuq_lut){.bits = kt->bits, .n_tables = kt->n_tables, .head_dim = a->p.head_dim, .levels = kt->levels};
        }
        if (a->v && a->v[l].levels)
            t[l].v_lut = (kvq_nuq_lut){.bits = a->v[l].bits, .n_tables = a->v[l].n_tables, .head_dim = a->p.head_dim,
                                       .levels = a->v[l].levels};
    }
    *out = t;
    return KVQ_OK;
}

kvq_status kvq_kv_desc_from_artifact(const kvq_artifact *a, kvq_kv_desc *d, kvq_kv_layer_tables **tables, kvq_err *err)
{
    memset(d, 0, sizeof *d);
    *tables = NULL;
    const kvq_family *f = a->p.method;
    if (!f || !f->from_params)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "artifact: method %s has no scheme of its own", f ? f->name : "?");
    d->q.fam = f;
    f->from_params(&a->p, &d->q);
    bool post = a->p.post_rope || (f->artifact && f->artifact->post_rope_only);
    d->key_stage = post ? KVQ_KEYS_POST_ROPE : KVQ_KEYS_PRE_ROPE;
    d->rot = a->p.rotation; /* tables fitted on rotated K / V are read through the same rotation */
    KVQ_TRY(kvq_kv_layer_tables_view(a, tables, err));
    d->layers = *tables;
    d->n_layers = (int)a->p.n_layers;
    d->art = a;
    return KVQ_OK;
}
